"""The FastAPI application: routes, API-key check, cancellation on disconnect, engine lifecycle.

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models[/{id}]`` (API key required when one
is set), and the open service routes (``service_routes.py``). Handlers only use ``AsyncLLM``'s public
methods. ``/openapi.json`` documents what they answer (``openapi.py``).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Receive, Scope, Send

import tandem
from tandem.engine.async_llm import AsyncLLM
from tandem.server import errors
from tandem.server.metrics import ServerMetrics
from tandem.server.openapi import error_responses, generation_responses, install_openapi
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest
from tandem.server.protocol_responses import ChatCompletionResponse, CompletionResponse, ModelCard, ModelList
from tandem.server.service_routes import add_service_routes
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
    app.add_middleware(JSONBodyMiddleware)
    app.add_middleware(ArrivalMiddleware)  # NOTE: added last, so it runs first
    v1 = APIRouter(prefix="/v1")

    @v1.post("/completions", responses=generation_responses(CompletionResponse))
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await cancel_on_disconnect(raw, completions.create(body, arrival_time(raw)))

    @v1.post("/chat/completions", responses=generation_responses(ChatCompletionResponse))
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await cancel_on_disconnect(raw, chat.create(body, arrival_time(raw)))

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, created=started, root=engine.model_dir, max_model_len=engine.max_model_len)

    @v1.get("/models", response_model=ModelList)
    async def list_models() -> dict[str, Any]:
        return ModelList(data=[card(name) for name in served_model_names]).model_dump()

    @v1.get("/models/{model_id:path}", response_model=ModelCard, responses=error_responses(404))
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        if model_id not in served_model_names:
            raise errors.model_not_found(model_id)
        return card(model_id).model_dump()

    app.include_router(v1)
    add_service_routes(app, engine, names, metrics)
    install_openapi(app, api_key is not None, engine.vocab_size)
    return app


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


# Routes whose body is JSON whatever the client's Content-Type says.
JSON_BODY_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"})


class JSONBodyMiddleware:
    """Reads a POST body on the JSON routes as JSON whatever its ``Content-Type`` (``text/plain``, a
    form type, none): ``curl -d`` sends ``application/x-www-form-urlencoded``, and FastAPI would
    otherwise answer valid JSON with a misleading "must be a JSON object". A body that is not JSON
    then gets "the request body is not valid JSON"."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST" and scope.get("path") in JSON_BODY_PATHS:
            content_type = Headers(scope=scope).get("content-type", "").split(";")[0].strip().lower()
            if content_type != "application/json" and not content_type.endswith("+json"):
                MutableHeaders(scope=scope)["content-type"] = "application/json"
        await self.app(scope, receive, send)
