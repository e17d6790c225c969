"""`tandem bench`: benchmark client for any OpenAI-compatible server, plus offline throughput."""
