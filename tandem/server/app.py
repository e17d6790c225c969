"""The FastAPI application: routes, API-key check, cancellation on disconnect, engine lifecycle.

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models[/{id}]`` (API key required when one
is set), and ``/health``, ``/load``, ``/version``, ``/tokenize``, ``/detokenize``, ``/metrics`` (open,
as in vLLM). Handlers only use ``AsyncLLM``'s public methods.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

import tandem
from tandem.engine.async_llm import AsyncLLM
from tandem.engine.processor import PromptError
from tandem.server import errors
from tandem.server.metrics import CONTENT_TYPE, ServerMetrics
from tandem.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from tandem.server.serving_chat import OpenAIServingChat
from tandem.server.serving_common import ModelNames
from tandem.server.serving_completions import OpenAIServingCompletion
from tandem.server.tools import ToolCalling


async def _wait_for_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(raw: Request, handler: Awaitable[Response]) -> Response:
    """Runs ``handler`` until it answers or the client disconnects; on disconnect it is cancelled,
    which aborts its engine requests (``RequestStream`` aborts when its consumer is cancelled).

    Streams are not covered here: Starlette's ``StreamingResponse`` cancels its body iterator when
    the client goes away.
    """
    task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return Response(status_code=499)  # NOTE: nobody is listening; nginx's "client closed request"


class APIKeyMiddleware:
    """Answers 401 to ``/v1`` requests without ``Authorization: Bearer <api_key>`` (as vLLM does).

    NOTE: an ASGI middleware rather than a route dependency, so the key is checked before the body is
    read: a wrong key with a malformed body is 401, not 400.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/")):
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key):
                await errors.invalid_api_key().response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(
    engine: AsyncLLM, served_model_names: list[str], api_key: str | None, metrics: ServerMetrics,
    tools: ToolCalling | None = None,
) -> FastAPI:
    """The ASGI app for one engine. Starting it starts the engine's output loop; stopping it
    (after uvicorn's graceful drain) shuts the engine-core process down. ``tools``: the tool-calling
    settings (default: no auto tool choice)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="Tandem", version=tandem.__version__, lifespan=lifespan)
    errors.install_error_handlers(app)
    names = ModelNames(served_model_names)
    completions = OpenAIServingCompletion(engine, names)
    chat = OpenAIServingChat(engine, names, tools)
    started = int(time.time())
    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(ArrivalMiddleware)  # NOTE: added last, so it runs first
    v1 = APIRouter(prefix="/v1")

    @v1.post("/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await cancel_on_disconnect(raw, completions.create(body, arrival_time(raw)))

    @v1.post("/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await cancel_on_disconnect(raw, chat.create(body, arrival_time(raw)))

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, created=started, root=engine.model_dir, max_model_len=engine.max_model_len)

    @v1.get("/models")
    async def list_models() -> dict[str, Any]:
        return ModelList(data=[card(name) for name in served_model_names]).model_dump()

    @v1.get("/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        if model_id not in served_model_names:
            raise errors.model_not_found(model_id)
        return card(model_id).model_dump()

    app.include_router(v1)
    _add_service_routes(app, engine, names, metrics)
    return app


def _add_service_routes(app: FastAPI, engine: AsyncLLM, names: ModelNames, metrics: ServerMetrics) -> None:
    """Health, version, metrics, tokenize and detokenize."""

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        engine.check_available()
        return Response(status_code=200)

    @app.get("/load")
    async def load() -> JSONResponse:
        """Running / waiting engine requests, KV usage (0..1), block size (tokens), instance id."""
        return JSONResponse(engine.load())

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": tandem.__version__, "kernel_backend": engine.client.kernel_backend}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        names.resolve(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise errors.bad_request("give exactly one of prompt or messages", "prompt")
        source = body.prompt if body.messages is None else [m.to_template_message(i) for i, m in
                                                            enumerate(body.messages)]
        ids = await engine.run_in_tokenizer(engine.count_tokens, source, body.add_special_tokens,
                                            body.add_generation_prompt)
        return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                             "token_strs": None})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        names.resolve(body.model)
        vocab = engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise PromptError(f"token id {bad[0]} is out of the vocabulary [0, {vocab})", "tokens")
        return JSONResponse({"prompt": await engine.run_in_tokenizer(engine.decode, body.tokens)})



def arrival_time(raw: Request) -> float:
    """``time.monotonic()`` when the request arrived (stamped by ``ArrivalMiddleware``, else now)."""
    return raw.scope.get("tandem.arrival", time.monotonic())


class ArrivalMiddleware:
    """Stamps ``scope["tandem.arrival"]`` (monotonic seconds) as the request arrives, before the body
    is read and validated: TTFT and e2e latency start there, as in vLLM."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope["tandem.arrival"] = time.monotonic()
        await self.app(scope, receive, send)
