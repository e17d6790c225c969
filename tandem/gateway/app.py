"""The gateway's ASGI app: `/v1/*` proxied, `/gateway/status` (JSON), `/gateway/` (live page),
`/metrics` (Prometheus), `/health`.

Client authentication: with an api_key, `/v1` requests need `Authorization: Bearer <key>` (401
otherwise, OpenAI's body); the key is checked with `hmac.compare_digest` and never forwarded. The
status JSON and page need the same key, as a Bearer token or as the password of HTTP Basic
credentials (any user name), so that a browser asks for it once and the page's live refresh sends
it along. `/metrics` and `/health` stay open, as vLLM leaves them with `--api-key` (Prometheus
scrapes without the clients' key); neither holds a URL, a key or any request text.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import tandem
from tandem.gateway.config import GatewayConfig
from tandem.gateway.proxy import Gateway
from tandem.gateway.status_page import render_status_page
from tandem.gateway.upstream import error_json


def _authorized(request: Request, api_key: str | None, basic: bool = False) -> bool:
    """True without an api_key, or when the request carries it (Bearer; with `basic` also as the
    password of HTTP Basic credentials)."""
    if api_key is None:
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if basic and scheme.lower() == "basic":
        try:
            token = base64.b64decode(token.strip(), validate=True).decode().partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return False
    elif scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), api_key.encode())


def _refused(challenge: str) -> JSONResponse:
    body = error_json(401, "Incorrect API key provided.", "invalid_api_key")
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": challenge})


def build_gateway_app(config: GatewayConfig, gateway: Gateway | None = None) -> FastAPI:
    """The app for one gateway (a new `Gateway(config)` unless one is given, e.g. with a test clock).
    Starting the app opens the gateway's HTTP client; stopping it ends shadow legs."""
    gw = gateway or Gateway(config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gw.start()
        try:
            yield
        finally:
            await gw.close()

    app = FastAPI(title="Tandem gateway", version=tandem.__version__, lifespan=lifespan, redirect_slashes=False)
    app.state.gateway = gw

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        """The gateway's own 404 / 405 (a path outside /v1 and its pages) as OpenAI error JSON."""
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = {"error": {"message": str(exc.detail), "type": kind, "param": None, "code": None}}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def proxy(path: str, request: Request) -> Response:
        if not _authorized(request, config.api_key):
            return _refused("Bearer")
        return await gw.handle(request, path)

    @app.get("/gateway/status")
    async def status(request: Request) -> JSONResponse:
        if not _authorized(request, config.api_key, basic=True):
            return _refused("Bearer")
        return JSONResponse(gw.status())

    @app.get("/gateway/")
    async def page(request: Request) -> Response:
        if not _authorized(request, config.api_key, basic=True):
            return _refused('Basic realm="tandem gateway", charset="UTF-8"')
        return HTMLResponse(render_status_page(gw.status()))

    @app.get("/gateway")
    async def page_redirect() -> RedirectResponse:
        return RedirectResponse("/gateway/")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gw.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return app


def run_gateway(config: GatewayConfig, log_level: str = "warning") -> None:
    """Serves the gateway with uvicorn on `config.host:config.port` until interrupted."""
    import uvicorn

    from tandem.server.signals import exit_zero_on_signals

    exit_zero_on_signals()  # NOTE: uvicorn raises the signal again after its graceful shutdown: exit 0, not 143
    uvicorn.run(build_gateway_app(config), host=config.host, port=config.port, log_level=log_level.lower(),
                timeout_graceful_shutdown=5)
