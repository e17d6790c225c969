"""A scripted OpenAI-compatible backend for the gateway tests, and a uvicorn-in-a-thread runner.

`FaultyBackend.mode` decides each answer: `ok` (a fixed 3-chunk stream or JSON answer), `error`
(500 with an OpenAI error body), `slow` (ok, each chunk `delay_s` late), `midstream` (two chunks,
then the connection breaks), `stall` (every request waits until `release` is set), `stall_shadow`
(only shadow legs wait). With `stream_options.include_usage` its chunks carry `"usage": null` and a
usage chunk comes last, as OpenAI's do. It records every request's headers and body.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

TEXT_CHUNKS = ["Once", " upon", " a time"]


def _chunk(text: str, finish: str | None, model: str, usage: bool) -> bytes:
    event = {"id": "cmpl-faulty", "object": "text_completion", "created": 0, "model": model,
             "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    if usage:
        event["usage"] = None
    return f"data: {json.dumps(event)}\n\n".encode()


class FaultyBackend:
    def __init__(self, model: str = "faulty") -> None:
        self.model = model
        self.mode = "ok"
        self.delay_s = 0.0
        self.release = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.requests: list[dict[str, Any]] = []
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            self.loop = asyncio.get_running_loop()
            body = await request.json()
            shadow = request.headers.get("x-tandem-shadow") == "1"
            self.requests.append({"headers": dict(request.headers), "body": body, "shadow": shadow})
            if self.mode == "error":
                return JSONResponse({"error": {"message": "planted failure", "type": "server_error", "param": None,
                                               "code": None}}, status_code=500)
            if self.mode == "stall" or (self.mode == "stall_shadow" and shadow):
                await self.release.wait()
            if body.get("stream"):
                return StreamingResponse(self._stream(body), media_type="text/event-stream")
            return JSONResponse({"id": "cmpl-faulty", "object": "text_completion", "created": 0, "model": self.model,
                                 "choices": [{"index": 0, "text": "".join(TEXT_CHUNKS), "logprobs": None,
                                              "finish_reason": "length"}],
                                 "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}})

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model"}]})

        @app.get("/v1/models/{model_id}")
        async def model(model_id: str) -> JSONResponse:
            if model_id != self.model:
                return JSONResponse({"error": {"message": f"no model {model_id}", "type": "invalid_request_error",
                                               "param": None, "code": "model_not_found"}}, status_code=404)
            return JSONResponse({"id": self.model, "object": "model"})

        return app

    def release_shadows(self) -> None:
        """Lets stalled shadow legs go on (thread-safe)."""
        self.loop.call_soon_threadsafe(self.release.set)

    async def _stream(self, body: dict[str, Any]):
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        for i, text in enumerate(TEXT_CHUNKS):
            if self.mode == "midstream" and i == 2:
                raise RuntimeError("planted mid-stream death")
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            yield _chunk(text, "length" if i == len(TEXT_CHUNKS) - 1 else None, self.model, usage)
        if usage:
            usage = {"id": "cmpl-faulty", "object": "text_completion", "created": 0, "model": self.model,
                     "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}
            yield f"data: {json.dumps(usage)}\n\n".encode()
        yield b"data: [DONE]\n\n"


class ThreadServer:
    """Runs an ASGI app with uvicorn on a free loopback port in a daemon thread."""

    def __init__(self, app: Any) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn thread did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


if __name__ == "__main__":
    # NOTE: `python faulty_backend.py PORT DELAY_S` serves the ok mode in its own process (a candidate
    # that a drill can kill).
    import sys

    backend = FaultyBackend()
    backend.delay_s = float(sys.argv[2])
    uvicorn.run(backend.app, host="127.0.0.1", port=int(sys.argv[1]), log_level="error")
