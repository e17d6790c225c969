"""OpenAI-compatible HTTP server (`tandem serve`): FastAPI front end, engine core in its own process."""
