"""``tandem serve``: load the tokenizer here, the model in an engine-core process, then run uvicorn.

The listening port is bound first, so a port in use fails at once, before any model loads.
SIGTERM or SIGINT (Ctrl-C): uvicorn stops accepting connections and lets in-flight requests finish for up
to ``--shutdown-timeout`` seconds; requests still running then are ended with an error (streams get an
error event and ``[DONE]``); then the engine core is stopped and the command exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def add_serve_parser(
    sub: argparse._SubParsersAction, add_engine_args: Callable[[argparse.ArgumentParser], None]
) -> None:
    """Registers ``serve`` with the engine flags and the server flags (vLLM spelling)."""
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    # NOTE: the engine core has a process of its own here, so its threads are pinned by default.
    add_engine_args(p, cpu_bind_default="auto")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names the API answers to (default: the --model value)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                   help="require this bearer key on /v1 routes (default: $TANDEM_API_KEY)")
    p.add_argument("--max-queue-len", type=int, default=0,
                   help="waiting requests beyond which new ones get 429 (0 = unbounded)")
    p.add_argument("--log-requests", action="store_true", help="log prompt text and parameters")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM; then they end with an error")
    p.set_defaults(func=cmd_serve)


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    # NOTE: active while loading and after uvicorn's drain; uvicorn re-raises the signal it caught
    # once it has shut down gracefully, and that shutdown is a success, so the exit code is 0.
    raise SystemExit(0)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening: clients are refused until uvicorn
    serves). Raises: OSError when the port is outside 0-65535, the address is in use or cannot be
    resolved."""
    if not 0 <= port <= 65535:
        # NOTE: getaddrinfo would wrap it modulo 65536 and bind another port without a word.
        raise OSError(f"port must be 0-65535, got {port}")
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def make_server(config: Any, shutdown_timeout: float, on_deadline: Callable[[], None]) -> Any:
    """A ``uvicorn.Server`` with a deadline: ``shutdown_timeout`` s after the first SIGTERM/SIGINT,
    ``on_deadline`` ends the requests still running, so uvicorn's drain then finishes on its own."""
    import uvicorn

    class Server(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None

        async def serve(self, sockets: list[socket.socket] | None = None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first and self.loop is not None:
                # NOTE: this runs in a signal handler: hand the timer to the loop thread-safely.
                self.loop.call_soon_threadsafe(self.loop.call_later, shutdown_timeout, on_deadline)

    return Server(config)


def cmd_serve(args: argparse.Namespace) -> int:
    """Runs the server until SIGTERM/SIGINT. Returns 0 after a graceful shutdown.

    Raises:
        ValueError / FileNotFoundError: bad flags or model (the CLI prints them and exits 2).
    Returns 1 when the port cannot be bound or the engine-core process fails while loading the model.
    """
    from tandem.cli import engine_config_from_args
    from tandem.engine.core_client import EngineCoreClient, EngineCoreStartError
    from tandem.engine.loading import load_chat_template
    from tandem.models.resolve import resolve_model_path
    from tandem.worker.cpu_env import pin_frontend, plan_cpus

    t0 = time.monotonic()
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    logging.getLogger("tandem.requests").setLevel(logging.INFO)
    config = engine_config_from_args(args)
    plan_cpus(config.cpu_bind, config.num_threads)  # NOTE: a bad --cpu-bind fails here, before the core starts
    names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"tandem: error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    log_level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    try:
        load_chat_template(config.model.chat_template)  # NOTE: a bad --chat-template fails before the core starts
        # NOTE: the core is spawned before the front end imports FastAPI, uvicorn and transformers (which
        # imports torch): those imports and the tokenizer load then overlap the core's model load.
        client = EngineCoreClient.start(resolve_model_path(config.model.model), config, log_level)
        try:
            import uvicorn

            from tandem.engine.async_llm import AsyncLLM
            from tandem.engine.loading import load_frontend
            from tandem.server.app import build_app
            from tandem.server.metrics import ServerMetrics

            frontend = load_frontend(config)
            logger.info("front end ready in %.1f s; waiting for the engine core", time.monotonic() - t0)
            client.wait_ready()
        except EngineCoreStartError as e:
            client.close()
            print(f"tandem: error: {e}", file=sys.stderr)
            return 1
        except BaseException:
            client.close()
            raise
        engine = AsyncLLM(frontend, client, log_requests=args.log_requests,
                          max_queue_len=config.scheduler.max_queue_len)
        try:
            # NOTE: after the spawn: the core inherits the mask of this process and then pins itself.
            pin_frontend(config.cpu_bind, config.num_threads)
            metrics = ServerMetrics(names[0], core_pid=lambda: engine.client.pid if engine.is_healthy else None,
                                    kernel_backend=client.kernel_backend)
            engine.metrics = metrics
            app = build_app(engine, names, args.api_key, metrics)
            print(f"tandem: engine ready in {time.monotonic() - t0:.1f} s (core pid {engine.client.pid}, "
                  f"kernels {client.kernel_backend}); "
                  f"serving {names[0]} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
            # NOTE: uvicorn's own drain timeout is a backstop; ours ends the requests first, cleanly.
            uv_config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=5,
                                       timeout_graceful_shutdown=args.shutdown_timeout + 5.0)
            server = make_server(uv_config, args.shutdown_timeout, lambda: _end_in_flight(engine, args))
            server.run(sockets=[sock])
        finally:
            engine.client.close()
    finally:
        sock.close()
    return 0


def _end_in_flight(engine: Any, args: argparse.Namespace) -> None:
    count = engine.end_all("the server is shutting down")
    if count:
        logger.warning("shutdown timeout (%.1f s) reached: ended %d request(s) still running",
                       args.shutdown_timeout, count)
