"""``tandem router``: an OpenAI-compatible front over several backends (FastAPI + httpx).

Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (routed by the policy, bodies and SSE
streams passed through, ``proxy.py``); ``GET /v1/models`` (the first healthy backend's answer);
``GET /health`` (200 while a backend is healthy, else 503); ``GET /backends`` (each backend's state
as JSON); ``GET /metrics`` (``metrics.py``).

Start-up (``RouterService.start``): each backend's ``GET /load`` is read (Tandem servers answer it)
for the block size, the KV event endpoint and the cache size (read again when a backend first
answers later, or comes back from an ejection: a restarted engine may publish elsewhere); the
tokenizer is ``--tokenizer`` or (``with_default_tokenizer``, before the server starts) the first
backend's ``/v1/models`` ``root`` when that is a local path (required for kv-aware); KV event
subscribers start; the health task probes every backend each ``health_interval_s``, each on its
own (an ejected one only when its ejection time is up, ``health.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.config import ConfigError
from tandem.router.backend import HttpBackend
from tandem.router.config import RouterConfig
from tandem.router.metrics import CONTENT_TYPE, RouterMetrics
from tandem.router.policy import make_policy
from tandem.router.prompt import PromptReader
from tandem.router.proxy import DROP_RESPONSE_HEADERS, Router, filter_headers
from tandem.server.errors import http_exception_response

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16  # CacheConfig.block_size
NO_TOKENIZER = "the kv-aware policy needs the backends' tokenizer: pass --tokenizer PATH"


def _models_root(url: str, timeout_s: float) -> tuple[bool, Any]:
    """(answered, the first model's ``root``) of ``url``'s ``GET /v1/models``; answered is False when
    it could not be reached or did not answer 200 JSON."""
    try:
        r = httpx.get(f"{url}/v1/models", timeout=timeout_s)
        if r.status_code != 200:
            return False, None
        return True, r.json()["data"][0].get("root")
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return False, None


def with_default_tokenizer(config: RouterConfig, clock=time.monotonic, sleep=time.sleep) -> RouterConfig:
    """``config`` with ``tokenizer`` set to the first answering backend's ``/v1/models`` ``root`` when
    that is a local path and none was given (blocking HTTP, before the server starts). When kv-aware
    needs it and no backend answers yet (they may still be loading), polls every second for up to
    ``backend_startup_timeout_s``, saying so once on stderr.

    Raises:
        ConfigError: kv-aware and no tokenizer found (a backend answered without a local ``root``, or
            none answered in time).
    """
    if config.tokenizer is not None:
        return config
    deadline = clock() + (config.backend_startup_timeout_s if config.policy == "kv-aware" else 0.0)
    said = False
    why = f"no backend answered GET /v1/models within {config.backend_startup_timeout_s:g} s"
    while True:
        for url in config.backends:
            answered, root = _models_root(url, config.connect_timeout_s)
            if not answered:
                continue
            if isinstance(root, str) and os.path.exists(root):
                return dataclasses.replace(config, tokenizer=root)
            deadline = 0.0  # a backend answered without a local tokenizer path: waiting will not help
            why = f"{url}/v1/models names no local folder (its model root: {root!r})"
            break
        if clock() >= deadline:
            break
        if not said:
            print(f"tandem router: waiting up to {config.backend_startup_timeout_s:g} s for a backend to answer "
                  "/v1/models (kv-aware needs its tokenizer; or pass --tokenizer)", file=sys.stderr, flush=True)
            said = True
        sleep(1.0)
    if config.policy == "kv-aware":
        raise ConfigError(f"{NO_TOKENIZER} ({why})")
    return config


def load_router_tokenizer(config: RouterConfig) -> Any | None:
    """``config.tokenizer`` loaded (None: none; ``with_default_tokenizer`` resolves the default first).

    Raises:
        ConfigError: kv-aware without a tokenizer, or one that does not load.
    """
    if config.tokenizer is None:
        if config.policy == "kv-aware":
            raise ConfigError(NO_TOKENIZER)
        return None
    from tandem.bench.datasets import load_tokenizer

    try:
        return load_tokenizer(config.tokenizer)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load the tokenizer {config.tokenizer}: {e}") from e


def router_chat_template(config: RouterConfig) -> str | None:
    """The ``--chat-template`` text (``engine.loading.load_chat_template``).

    Raises:
        ConfigError: neither a readable file nor a Jinja template, or it does not compile.
    """
    from tandem.engine.loading import load_chat_template

    try:
        return load_chat_template(config.chat_template)
    except ValueError as e:
        raise ConfigError(str(e)) from e


class RouterService:
    """The router's long-lived parts: backends, HTTP client, health task, KV event subscribers.

    Args:
        config: the settings. tokenizer: a loaded tokenizer to use instead of discovering one (tests).
        transport: an httpx transport for the backends (tests: ``httpx.MockTransport``), or None.
    """

    def __init__(self, config: RouterConfig, tokenizer: Any | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self._tokenizer = tokenizer
        timeout = httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport)
        self.metrics: RouterMetrics | None = None
        self.backends: list[HttpBackend] = []
        self.router: Router | None = None
        self._health_task: asyncio.Task | None = None

    async def start(self) -> None:
        """Discovers the backends, loads the tokenizer, starts subscribers and the health task.

        Raises:
            ConfigError: kv-aware without a tokenizer, or a tokenizer that does not load.
        """
        cfg = self.config
        self.backends = [HttpBackend(url, cfg, self._ejected(url)) for url in cfg.backends]
        loads = await asyncio.gather(*(b.fetch_load(self.client) for b in self.backends))
        sizes = [x["block_size"] for x in loads if x and isinstance(x.get("block_size"), int)]
        self.block_size = block_size = cfg.block_size or (sizes[0] if sizes else DEFAULT_BLOCK_SIZE)
        for b in self.backends:
            b.configure(block_size)
            for sub in b.subscribers:
                sub.start()
        self.metrics = RouterMetrics([b.state for b in self.backends])
        tokenizer = self._tokenizer if self._tokenizer is not None else await self._load_tokenizer()
        reader = PromptReader(tokenizer, block_size, router_chat_template(cfg))
        self.router = Router(cfg, self.backends, make_policy(cfg.policy, cfg.beta, cfg.min_match), reader, self.client,
                             self.metrics)
        self._health_task = asyncio.get_running_loop().create_task(self._health_loop(), name="router-health")
        logger.info("router: %s, policy %s, block size %d, tokenizer %s", _backends(len(self.backends)), cfg.policy,
                    block_size, "yes" if tokenizer is not None else "none")

    def _ejected(self, url: str):
        def count(reason: str) -> None:
            if self.metrics is not None:
                self.metrics.ejections.labels(url).inc()
        return count

    async def _load_tokenizer(self) -> Any | None:
        """``load_router_tokenizer`` off the event loop (``run_router`` loads it before the server starts)."""
        return await asyncio.to_thread(load_router_tokenizer, self.config)

    async def _health_loop(self) -> None:
        # NOTE: one loop per backend: a hung backend's probe (up to its 5 s read timeout) delays no other's
        await asyncio.gather(*(self._probe_loop(b) for b in self.backends))

    async def _probe_loop(self, b: HttpBackend) -> None:
        while True:
            await self._check(b)
            await asyncio.sleep(self.config.health_interval_s)

    async def _check(self, b: HttpBackend) -> None:
        from tandem.router.health import HealthState

        ejected = b.health.state is HealthState.EJECTED
        if ejected and not b.health.due_probe:
            return
        ok, reason, silent = await b.probe(self.client)
        if not ok:
            self.metrics.errors.labels(b.url, "probe").inc()
        b.health.on_probe(ok, reason, silent)
        if ok and (ejected or not b.answered_load):
            await self._rediscover(b)
        elif ok and b.load is not None:  # NOTE: a Tandem server (it answers /load)
            await self._follow_engines(b)

    async def _rediscover(self, b: HttpBackend) -> None:
        """A backend back from an ejection, or up after the router started: its ``/load`` again, and
        a new index (from its snapshot, or empty) with a new KV event subscription when the endpoint
        moved or went, or when it is another server process (a new ``instance_id``: a restarted one
        holds none of the blocks indexed). Changes: the backend's index and subscriber."""
        before = (b.load or {}).get("instance_id")
        if await b.fetch_load(self.client) is None:
            return
        restarted = before is not None and b.load.get("instance_id") != before
        if not (restarted or b.events_moved()):
            return
        await self._resubscribe(b)

    async def _follow_engines(self, b: HttpBackend) -> None:
        """A healthy Tandem backend: its ``/load`` again (each probe), so that an engine core restarted inside
        it (a ``-dp`` server stays healthy meanwhile) gets an empty index and a subscription at its new
        endpoint, instead of its dead core's blocks being counted as hits; and a backend that starts to
        publish KV events (all its engines) is subscribed to.
        Changes: that engine's index and subscriber (all of them when the server itself is another one)."""
        before = (b.load or {}).get("instance_id")
        if await b.fetch_load(self.client) is None:
            return
        if not b.subscribers:  # NOTE: an approximate index: events may have started (an engine came back)
            if b.events_moved():
                await self._resubscribe(b)
            return
        ranks = b.restarted_feeds()
        if ranks is None or before is not None and b.load.get("instance_id") != before:
            await self._resubscribe(b)
            return
        for rank in ranks:
            await b.subscribers[rank].close()
            sub = b.renew_feed(rank)
            logger.info("backend %s: engine %d restarted: its index starts empty; KV events from %s",
                        b.url, rank, sub.endpoint)
            sub.start()
        b.forget_stopped_engines()

    async def _resubscribe(self, b: HttpBackend) -> None:
        """A new index and KV event subscriptions from the backend's current ``/load``. Changes: the
        backend's index and subscribers."""
        for sub in b.subscribers:
            await sub.close()
        b.configure(self.block_size)
        if b.subscribers:
            logger.info("backend %s: KV events now from %s", b.url, ", ".join(sub.endpoint for sub in b.subscribers))
        for sub in b.subscribers:
            sub.start()

    async def stop(self) -> None:
        """Stops the health task and the subscribers, closes the client."""
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        for b in self.backends:
            for sub in b.subscribers:
                await sub.close()
        await self.client.aclose()

    async def models(self) -> Response:
        """The first healthy backend's ``/v1/models`` answer, passed through."""
        for b in self.backends:
            if not b.state.healthy:
                continue
            try:
                r = await self.client.get(f"{b.url}/v1/models", timeout=self.config.connect_timeout_s)
            except httpx.HTTPError:
                continue
            headers = dict(filter_headers(r.headers, DROP_RESPONSE_HEADERS))
            return Response(r.content, r.status_code, headers=headers)
        return JSONResponse({"error": {"message": "no healthy backend", "type": "service_unavailable",
                                       "param": None, "code": "no_healthy_backend"}}, 503,
                            headers={"Retry-After": "1"})

    def describe(self) -> list[dict[str, Any]]:
        return [b.describe(self.metrics.hit_rate_of(b.url)) for b in self.backends]


def build_app(service: RouterService) -> FastAPI:
    """The FastAPI app of a router service (started and stopped by the app's lifespan)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="tandem router", lifespan=lifespan)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return http_exception_response(exc)  # unknown paths and methods: OpenAI error JSON, as tandem serve

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await service.router.forward(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await service.router.forward(request, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models() -> Response:
        return await service.models()

    @app.get("/health")
    async def health() -> Response:
        n = sum(b.state.healthy for b in service.backends)
        return JSONResponse({"healthy_backends": n}, 200 if n else 503)

    @app.get("/backends")
    async def backends() -> JSONResponse:
        cfg = service.config
        knobs = {"kv_beta": cfg.beta, "kv_min_match": cfg.min_match} if cfg.policy == "kv-aware" else {}
        return JSONResponse({"policy": cfg.policy, **knobs, "backends": service.describe()})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE)

    return app


def run_router(config: RouterConfig, log_level: str = "info") -> int:
    """Serves the router until interrupted (uvicorn on ``config.host:config.port``).

    Raises:
        ConfigError: kv-aware and no tokenizer (``with_default_tokenizer``), a tokenizer that does not
            load, or a bad chat template (all before the server starts).
    """
    config = with_default_tokenizer(config)
    router_chat_template(config)  # NOTE: a bad tokenizer or template is a one-line error, not a failed lifespan
    logging.getLogger("httpx").setLevel(logging.WARNING)  # NOTE: not a line per proxied request
    service = RouterService(config, tokenizer=load_router_tokenizer(config))
    return serve_router_app(build_app(service), config.host, config.port, log_level, lambda: (
        f"{_backends(len(service.backends))}, policy {config.policy}, block size {service.block_size}"))


def _backends(n: int) -> str:
    return f"{n} backend" if n == 1 else f"{n} backends"


def serve_router_app(app: FastAPI, host: str, port: int, log_level: str, describe: Callable[[], str]) -> int:
    """Serves ``app`` with uvicorn until interrupted; once it listens, prints ``tandem router: listening on
    http://HOST:PORT (DESCRIBE)`` on stderr (the port bound, for ``--port 0``; ``describe()`` is called
    then, after the app's start-up). Returns the exit code: 1 when it never started."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if not self.should_exit:  # listening: the one line a user (or a script) waits for
                bound = self.servers[0].sockets[0].getsockname()[1] if self.servers else port
                print(f"tandem router: listening on http://{host}:{bound} ({describe()})", file=sys.stderr,
                      flush=True)

    from tandem.server.signals import exit_zero_on_signals

    server = _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                                    timeout_graceful_shutdown=5))
    exit_zero_on_signals()  # NOTE: uvicorn raises the signal again after its graceful shutdown: exit 0, not 143
    server.run()
    return 0 if server.started else 1
