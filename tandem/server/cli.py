"""``tandem serve``: load the tokenizer here, the model in an engine-core process, then run uvicorn.

SIGTERM or SIGINT (Ctrl-C): uvicorn stops accepting connections and lets in-flight requests finish for up
to ``--shutdown-timeout`` seconds; then the engine core is stopped and the command exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def add_serve_parser(
    sub: argparse._SubParsersAction, add_engine_args: Callable[[argparse.ArgumentParser], None]
) -> None:
    """Registers ``serve`` with the engine flags and the server flags (vLLM spelling)."""
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(p)
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
                   help="seconds in-flight requests may take to finish after SIGTERM")
    p.set_defaults(func=cmd_serve)


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    # NOTE: active while loading and after uvicorn's drain; uvicorn re-raises the signal it caught
    # once it has shut down gracefully, and that shutdown is a success, so the exit code is 0.
    raise SystemExit(0)


def cmd_serve(args: argparse.Namespace) -> int:
    """Runs the server until SIGTERM/SIGINT. Returns 0 after a graceful shutdown.

    Raises:
        ValueError / FileNotFoundError: bad flags or model (the CLI prints them and exits 2).
    Returns 1 when the engine-core process fails while loading the model.
    """
    import uvicorn

    from tandem.cli import engine_config_from_args
    from tandem.engine.async_llm import AsyncLLM
    from tandem.engine.core_client import EngineCoreStartError
    from tandem.server.app import build_app
    from tandem.server.metrics import ServerMetrics

    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    logging.getLogger("tandem.requests").setLevel(logging.INFO)
    config = engine_config_from_args(args)
    names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    t0 = time.monotonic()
    log_level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    try:
        engine = AsyncLLM.from_config(config, log_requests=args.log_requests, log_level=log_level)
    except EngineCoreStartError as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 1
    try:
        metrics = ServerMetrics(names[0], core_pid=lambda: engine.client.pid)
        engine.metrics = metrics
        app = build_app(engine, names, args.api_key, metrics)
        print(f"tandem: engine ready in {time.monotonic() - t0:.1f} s (core pid {engine.client.pid}); "
              f"serving {names[0]} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                    timeout_graceful_shutdown=args.shutdown_timeout, timeout_keep_alive=5)
    finally:
        engine.client.close()
    return 0
