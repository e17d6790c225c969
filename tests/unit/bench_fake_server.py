"""A scripted OpenAI-compatible server for the `tandem bench` tests.

Each request's prompt (or chat message) is its own script, e.g. `ttft=0.08 itl=0.05 n=5 mode=ok`:
the server sends token k (0-based) at ttft + k * itl seconds after it received the request,
measured against absolute deadlines so sleeps do not drift. Modes:
  ok            n token chunks, a usage chunk, `data: [DONE]`
  nousage       as ok without the usage chunk
  http500       answers 500 with a JSON error body
  drop          sends `drop_after` tokens, then breaks the connection (no terminating chunk)
  hang          sends nothing for an hour (the client's timeout must fire)
  badjson       one token, then a `data:` line that is not JSON
  nodone        n tokens, the last with finish_reason, then ends without `[DONE]` (valid)
  truncated     n tokens, none with finish_reason, ends without `[DONE]` (malformed)
Chat requests get a role-only header chunk immediately, before the first token. An `id=TAG` item
records the time the handler received the request in `FakeOpenAIServer.received[TAG]`.
`GET /stats` returns the peak number of requests in flight. `GET /v1/models` lists one model, with
`root` = `FakeOpenAIServer.model_root` when that is set (as vLLM and Tandem report the model path).
`GET /metrics` exists only with `metrics_prefix` set ("tandem" or "vllm"; "garbage" serves a page
that is not Prometheus text): real prometheus_client counters `<prefix>:spec_decode_num_drafts`,
`..._num_draft_tokens`, `..._num_accepted_tokens` and `..._num_accepted_tokens_per_pos{position}`
that every streamed request (warm-ups too) advances by `SPEC_PER_REQUEST` after its last token, before
its usage chunk and `[DONE]`. With `api_key` set, /metrics answers 401 without `Authorization: Bearer`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest

MODEL = "fake-model"
# Increase of each spec-decode counter per finished request: 3 drafts of k = 4 tokens, 7 accepted
# (3 at position 0, 2 at 1, 1 at 2, 1 at 3).
SPEC_PER_REQUEST = {"drafts": 3, "draft_tokens": 12, "accepted": 7, "per_pos": (3, 2, 1, 1)}


def parse_script(text: str) -> dict[str, Any]:
    script: dict[str, Any] = {"ttft": 0.05, "itl": 0.05, "n": 4, "mode": "ok", "drop_after": 2, "id": ""}
    for item in text.split():
        key, _, value = item.partition("=")
        if key in script:
            script[key] = type(script[key])(value)
    return script


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _choice(chat: bool, text: str, finish: str | None) -> dict[str, Any]:
    if chat:
        return {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    return {"index": 0, "text": text, "finish_reason": finish}


class _SpecCounters:
    """Spec-decode counters named and labelled as the real server's (vLLM adds an `engine` label)."""

    def __init__(self, prefix: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"] if prefix == "vllm" else ["model_name"]
        self.values = [MODEL, "0"] if prefix == "vllm" else [MODEL]

        def counter(name: str, extra: list[str]) -> Counter:
            return Counter(f"{prefix}:spec_decode_{name}", name, labels + extra, registry=self.registry)

        self.drafts = counter("num_drafts", []).labels(*self.values)
        self.draft_tokens = counter("num_draft_tokens", []).labels(*self.values)
        self.accepted = counter("num_accepted_tokens", []).labels(*self.values)
        self.per_pos = counter("num_accepted_tokens_per_pos", ["position"])
        self.drafts.inc(5)  # NOTE: non-zero before any request, so a run must report increases
        self.per_pos.labels(*self.values, "0").inc(2)

    def advance(self) -> None:
        self.drafts.inc(SPEC_PER_REQUEST["drafts"])
        self.draft_tokens.inc(SPEC_PER_REQUEST["draft_tokens"])
        self.accepted.inc(SPEC_PER_REQUEST["accepted"])
        for pos, count in enumerate(SPEC_PER_REQUEST["per_pos"]):
            self.per_pos.labels(*self.values, str(pos)).inc(count)


class FakeOpenAIServer:
    """Runs the app with uvicorn in a daemon thread on a free loopback port."""

    def __init__(self, metrics_prefix: str | None = None, api_key: str | None = None) -> None:
        self.metrics_prefix = metrics_prefix
        self.api_key = api_key
        self.spec = _SpecCounters(metrics_prefix) if metrics_prefix in ("tandem", "vllm") else None
        self.in_flight = 0
        self.model_root: str | None = None
        self.peak_in_flight = 0
        # id= tag of the script -> perf_counter() when the handler got the request (same clock as
        # the client's when the server runs in the test's process).
        self.received: dict[str, float] = {}
        self.app = self._build_app()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, log_level="critical", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self) -> FakeOpenAIServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            card = {"id": MODEL, "object": "model"}
            if self.model_root is not None:
                card["root"] = self.model_root
            return {"object": "list", "data": [card]}

        @app.get("/stats")
        async def stats() -> dict[str, Any]:
            return {"peak_in_flight": self.peak_in_flight}

        if self.metrics_prefix is not None:

            @app.get("/metrics")
            async def metrics(request: Request) -> Response:
                if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
                    return JSONResponse({"error": "unauthorized"}, status_code=401)
                if self.spec is None:
                    return PlainTextResponse("<html>not prometheus</html>")
                return Response(generate_latest(self.spec.registry), media_type="text/plain")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            body = await request.json()
            return self._respond(parse_script(body["prompt"]), body, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            body = await request.json()
            return self._respond(parse_script(body["messages"][-1]["content"]), body, chat=True)

        return app

    def _respond(self, script: dict[str, Any], body: dict[str, Any], chat: bool) -> Any:
        t0 = time.perf_counter()
        if script["id"]:
            self.received[script["id"]] = t0
        if script["mode"] == "http500":
            return JSONResponse({"error": {"message": "scripted failure", "code": 500}}, status_code=500)
        return StreamingResponse(self._stream(script, body, chat, t0), media_type="text/event-stream")

    async def _stream(
        self, script: dict[str, Any], body: dict[str, Any], chat: bool, t0: float
    ) -> AsyncIterator[bytes]:
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            async for chunk in self._chunks(script, body, chat, t0):
                yield chunk
        finally:
            self.in_flight -= 1

    async def _chunks(
        self, script: dict[str, Any], body: dict[str, Any], chat: bool, t0: float
    ) -> AsyncIterator[bytes]:
        mode, n = script["mode"], script["n"]
        obj = "chat.completion.chunk" if chat else "text_completion"
        if chat:
            yield _sse({"object": obj, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                    "finish_reason": None}]})
        if mode == "hang":
            await asyncio.sleep(3600)
        for k in range(n):
            await asyncio.sleep(max(0.0, t0 + script["ttft"] + k * script["itl"] - time.perf_counter()))
            if mode == "drop" and k == script["drop_after"]:
                raise ConnectionResetError("scripted drop")
            if mode == "badjson" and k == 1:
                yield b"data: {not json\n\n"
                return
            last = k == n - 1 and mode != "truncated"
            yield _sse({"object": obj, "choices": [_choice(chat, f"t{k} ", "length" if last else None)]})
        if self.spec is not None:
            self.spec.advance()
        if mode in ("nodone", "truncated"):
            return
        if mode != "nousage" and body.get("stream_options", {}).get("include_usage"):
            yield _sse({"object": obj, "choices": [],
                        "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}})
        yield b"data: [DONE]\n\n"

