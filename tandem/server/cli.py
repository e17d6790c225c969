"""``tandem serve``: load the tokenizer here, the model in an engine-core process, then run uvicorn.

The listening port is bound (and listened on) first, so a port in use fails at once, before any
model loads. ``serve()`` is the function a launcher calls; ``cmd_serve`` maps the flags onto
``EngineConfig`` and ``ServerConfig`` and calls it. SIGTERM or SIGINT (Ctrl-C): uvicorn stops accepting
connections and lets in-flight requests finish for up to ``--shutdown-timeout`` seconds; requests
still running then are ended with an error (streams get an error event and ``[DONE]``); then the
engine core is stopped and the command exits 0. A core that dies is restarted (see
``tandem/engine/supervisor.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from tandem.config import (
    DEFAULT_MAX_QUEUE_LEN,
    TOOL_CALL_PARSERS,
    EngineConfig,
    KVTransferConfig,
    ParallelConfig,
    ServerConfig,
)
from tandem.server.signals import exit_zero_on_signals

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def add_serve_parser(
    sub: argparse._SubParsersAction, add_engine_args: Callable[[argparse.ArgumentParser], None]
) -> None:
    """Registers ``serve`` with the engine flags and the server flags (vLLM spelling), one per
    ``ServerConfig`` field."""
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    # NOTE: the engine core has a process of its own here, so its threads are pinned by default.
    add_engine_args(p, cpu_bind_default="auto", kv_events=True)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names the API answers to (default: the --model value)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                   help="require this bearer key on /v1 routes (default: $TANDEM_API_KEY)")
    p.add_argument("--max-queue-len", type=int, default=DEFAULT_MAX_QUEUE_LEN,
                   help="waiting engine requests (queued in the core, or being tokenized) beyond which new "
                        f"ones get 429 with Retry-After (default {DEFAULT_MAX_QUEUE_LEN}; 0 = unbounded)")
    p.add_argument("--log-requests", action="store_true", help="log prompt text and parameters")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM; then they end with an error")
    p.add_argument("--core-restart-limit", type=int, default=3,
                   help="a dead engine core is restarted unless this is its Nth death within "
                        "--core-restart-window seconds (a crash loop; default 3; 1 = never restart)")
    p.add_argument("--core-restart-window", type=float, default=60.0, help="seconds (default 60)")
    p.add_argument("--instance-id", default=None, help="this server's id in /load and /metrics (default: a uuid)")
    p.add_argument("--disaggregate", action="store_true",
                   help="run a prefill server and a decode server on split cores (P/D disaggregation over "
                        "loopback TCP) behind one OpenAI-compatible port (tandem/disagg/launch.py)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto" (needs --tool-call-parser), as vLLM')
    p.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="how tool calls are read from the model's text (vLLM's names)")
    from tandem.cli import add_parallel_args

    add_parallel_args(p, listen=False)
    p.set_defaults(func=cmd_serve)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The frozen ServerConfig of the parsed flags (validation happens in the dataclass)."""
    return ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key,
        served_model_names=tuple(args.served_model_name or ()), log_requests=args.log_requests,
        shutdown_timeout=args.shutdown_timeout, core_restart_limit=args.core_restart_limit,
        core_restart_window=args.core_restart_window, instance_id=args.instance_id,
        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
    )


def kv_ports_error(kv: KVTransferConfig | None) -> str | None:
    """Why a producer's KV ports (``--kv-transfer-config`` ``kv_ip`` : ``kv_port`` / ``kv_data_port``) cannot
    be bound, or None. Checked before the model loads (the engine core binds them once it has)."""
    if kv is None or not kv.is_producer:
        return None
    for name, port in (("kv_port", kv.kv_port), ("kv_data_port", kv.kv_data_port)):
        if port == 0:
            continue
        try:
            bind_socket(kv.kv_ip, port).close()
        except OSError as e:
            return (f"cannot bind the KV transfer port {kv.kv_ip}:{port} (--kv-transfer-config {name}): "
                    f"{e.strerror or e}")
    return None


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening (connections wait in the backlog until
    uvicorn serves). Raises: OSError when the port is outside 0-65535, the address is in use or
    cannot be resolved.

    NOTE: ``SO_REUSEADDR`` lets a restarted server bind over connections in TIME_WAIT, but on Linux it
    also lets two sockets bind the same port as long as neither listens: listening at once makes a
    second server fail here, instead of both passing the check.
    """
    if not 0 <= port <= 65535:
        # NOTE: getaddrinfo would wrap it modulo 65536 and bind another port without a word.
        raise OSError(f"port must be 0-65535, got {port}")
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
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
    """``tandem serve``: the flags as configs, then ``serve``. Raises: see ``serve``."""
    from tandem.cli import engine_config_from_args, parallel_config_from_args

    if getattr(args, "engine_address", None) is not None:
        _refuse_engine_flags(args)
    if getattr(args, "disaggregate", False):
        return _serve_disaggregated(args)
    log_level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    return serve(engine_config_from_args(args), server_config_from_args(args), log_level,
                 default_name=args.model or DEFAULT_MODEL_NAME, parallel_config=parallel_config_from_args(args))


def _serve_disaggregated(args: argparse.Namespace) -> int:
    """``serve --disaggregate``: this command's own flags go to both sides (``disagg/launch.py``).

    Raises: ValueError: combined with --kv-transfer-config, --engine-address or -dp > 1.
    """
    from tandem.disagg.launch import serve_disaggregated

    if args.kv_transfer_config or getattr(args, "engine_address", None) or getattr(args, "data_parallel_size", 1) > 1:
        raise ValueError("--disaggregate sets up its own --kv-transfer-config for both sides; it cannot be combined "
                         "with --kv-transfer-config, --engine-address or --data-parallel-size > 1")
    rest = sys.argv[sys.argv.index("serve") + 1:] if "serve" in sys.argv else []
    return serve_disaggregated([a for a in rest if a != "--disaggregate"], args.host, args.port)


# Engine flags that still mean something with a remote core: the tokenizer's folder and its template.
_REMOTE_ENGINE_FLAGS = frozenset({"model", "chat_template"})


def _refuse_engine_flags(args: argparse.Namespace) -> None:
    """With ``--engine-address`` the engine runs elsewhere (``tandem engine`` takes its flags), so an
    engine flag given to ``serve`` would be silently ignored: refuse it instead.

    Raises:
        ValueError: an engine flag other than ``--model`` / ``--chat-template`` differs from its default.
    """
    from tandem.cli import add_engine_args

    probe = argparse.ArgumentParser(add_help=False)
    add_engine_args(probe, cpu_bind_default="auto", kv_events=True)
    given = [a.option_strings[0] for a in probe._actions if a.dest not in _REMOTE_ENGINE_FLAGS
             and a.option_strings and getattr(args, a.dest, a.default) != a.default]
    if given:
        raise ValueError(f"{', '.join(given)} configure the engine core, which runs elsewhere with "
                         "--engine-address: pass them to `tandem engine` instead")


def serve(engine_config: EngineConfig, server_config: ServerConfig, log_level: str = "WARNING",
          default_name: str = DEFAULT_MODEL_NAME, parallel_config: ParallelConfig | None = None) -> int:
    """Runs the server until SIGTERM/SIGINT. Returns 0 after a graceful shutdown, 1 when the port
    cannot be bound, the engine-core process fails while loading the model, or the remote engine
    core (``parallel_config.engine_address``) cannot be reached or refuses this server.

    ``log_level``: the engine core's logging level. ``default_name``: the served model name when
    ``server_config.served_model_names`` is empty. With an ``engine_address`` no model is loaded
    here: ``engine_config.model`` only names the tokenizer's folder (and chat template), and the
    default served name is the model the engine core reports (its folder's name).

    Raises:
        ValueError / FileNotFoundError: bad config or model (the CLI prints them and exits 2).
    """
    from tandem.worker.cpu_env import allowed_cpus, plan_cpus

    t0 = time.monotonic()
    exit_zero_on_signals()  # NOTE: while loading and after uvicorn's drain (server/signals.py)
    logging.getLogger("tandem.requests").setLevel(logging.INFO)
    dp = parallel_config is not None and (parallel_config.data_parallel_size > 1
                                          or parallel_config.data_parallel_backend == "ray")
    if dp and engine_config.kv_transfer is not None:
        raise ValueError("--kv-transfer-config serves one engine core per server (its kv_port); it cannot be "
                         "combined with --data-parallel-size > 1 or the ray backend yet")
    # NOTE: a bad --cpu-bind fails before any core starts
    if dp:
        from tandem.worker.dp_cpus import plan_engine_cpus

        if parallel_config.data_parallel_backend == "mp":
            plan_engine_cpus(parallel_config.data_parallel_size, engine_config.cpu_bind, engine_config.num_threads)
    else:
        plan_cpus(engine_config.cpu_bind, engine_config.num_threads)
    names = list(server_config.served_model_names) or [default_name]
    host, port = server_config.host, server_config.port
    try:
        sock = bind_socket(host, port)
    except OSError as e:
        print(f"tandem: error: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        return 1
    remote = parallel_config is not None and parallel_config.engine_address is not None
    kv_error = None if remote else kv_ports_error(engine_config.kv_transfer)
    if kv_error is not None:
        sock.close()
        print(f"tandem: error: {kv_error}", file=sys.stderr)
        return 1
    try:
        if remote:
            engine = _connect_engine(engine_config, server_config, parallel_config)
            if engine is not None and not server_config.served_model_names and engine.client.model:
                names = [engine.client.model]  # NOTE: the core's model; --model only names the tokenizer here
        elif dp:
            from tandem.server.data_parallel import start_data_parallel

            engine = start_data_parallel(engine_config, server_config, parallel_config, log_level, t0)
        else:
            engine = _start_engine(engine_config, server_config, log_level, allowed_cpus(), t0)
        if engine is None:
            return 1
        try:
            _run(engine, engine_config, server_config, names, sock, t0)
        finally:
            for one in getattr(engine, "engines", [engine]):
                one.client.close()
            if hasattr(engine, "launcher"):
                engine.launcher.close()
    finally:
        sock.close()
    return 0


def _start_engine(engine_config: EngineConfig, server_config: ServerConfig, log_level: str, cpus: list[int],
                  t0: float) -> Any:
    """Spawns the core, loads the front end meanwhile, waits for the core. Returns the ``AsyncLLM``,
    or None after printing why the core failed to start. Raises: ValueError / FileNotFoundError."""
    from tandem.engine.core_client import EngineCoreClient, EngineCoreStartError
    from tandem.engine.loading import load_chat_template
    from tandem.models.resolve import resolve_model_path

    load_chat_template(engine_config.model.chat_template)  # NOTE: a bad --chat-template fails before the core starts
    model_dir: Path = resolve_model_path(engine_config.model.model)
    # NOTE: the core is spawned before the front end imports FastAPI, uvicorn and transformers (which
    # imports torch): those imports and the tokenizer load then overlap the core's model load.
    client = EngineCoreClient.start(model_dir, engine_config, log_level, cpus)
    try:
        from tandem.engine.async_llm import AsyncLLM
        from tandem.engine.loading import load_frontend
        from tandem.engine.supervisor import CrashLoopGuard

        frontend = load_frontend(engine_config)
        logger.info("front end ready in %.1f s; waiting for the engine core", time.monotonic() - t0)
        client.wait_ready()
    except EngineCoreStartError as e:
        client.close()
        print(f"tandem: error: {e}", file=sys.stderr)
        return None
    except BaseException:
        client.close()
        raise
    guard = CrashLoopGuard(server_config.core_restart_limit, server_config.core_restart_window)
    return AsyncLLM(
        frontend, client, log_requests=server_config.log_requests,
        max_queue_len=engine_config.scheduler.max_queue_len, guard=guard, instance_id=server_config.instance_id,
        # NOTE: a restarted core gets the mask the server had before pinning its front end.
        start_core=lambda: EngineCoreClient.launch(model_dir, engine_config, log_level, cpus),
    )


def _connect_engine(engine_config: EngineConfig, server_config: ServerConfig, parallel: Any) -> Any:
    """Connects to the engine core at ``parallel.engine_address`` and loads the tokenizer. Returns the
    ``AsyncLLM``, or None after printing why the core cannot be used.

    Raises:
        ValueError / FileNotFoundError: bad tokenizer folder, or one whose vocabulary differs from the
            core's model.
    """
    from tandem.engine.async_llm import AsyncLLM
    from tandem.engine.core_client import EngineCoreStartError
    from tandem.engine.loading import load_frontend
    from tandem.engine.remote_client import RECONNECT_TIMEOUT_S, RemoteCoreSupervisor, RemoteEngineCoreClient

    address, secret = parallel.engine_address, parallel.secret()
    frontend = load_frontend(engine_config)
    try:
        client = RemoteEngineCoreClient.connect(address, secret)
    except EngineCoreStartError as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return None
    if client.vocab_size and client.vocab_size != frontend.hf_config.vocab_size:
        client.close()
        raise ValueError(f"the engine core at {address} serves {client.model!r} (vocabulary {client.vocab_size}) "
                         f"but --model {frontend.model_dir} has a vocabulary of {frontend.hf_config.vocab_size}: "
                         "pass the engine's model folder as --model")
    return AsyncLLM(
        frontend, client, log_requests=server_config.log_requests,
        max_queue_len=engine_config.scheduler.max_queue_len, instance_id=server_config.instance_id,
        start_core=lambda: RemoteEngineCoreClient.connect(address, secret, RECONNECT_TIMEOUT_S),
        supervisor_cls=RemoteCoreSupervisor,
    )


def _run(engine: Any, engine_config: EngineConfig, server_config: ServerConfig, names: list[str],
         sock: socket.socket, t0: float) -> None:
    """Builds the app around a ready engine and serves on ``sock`` until shutdown."""
    import uvicorn

    from tandem.server.app import build_app
    from tandem.server.tools import ToolCalling
    from tandem.worker.cpu_env import pin_frontend

    core_pid = engine.client.pid
    if hasattr(engine, "launcher"):
        where = f"{len(engine.engines)} engine cores: {engine.launcher.describe()}"
    elif core_pid is not None:
        # NOTE: after the spawn: the core inherits the mask of this process and then pins itself.
        pin_frontend(engine_config.cpu_bind, engine_config.num_threads)
        where = f"core pid {core_pid}"
    else:
        where = f"core at {getattr(engine.client, 'address', '?')}"
    metrics = _make_metrics(engine, names[0])
    engine.metrics = metrics
    tools = ToolCalling(server_config.enable_auto_tool_choice, server_config.tool_call_parser)
    app = build_app(engine, names, server_config.api_key, metrics, tools)
    print(f"tandem: engine ready in {time.monotonic() - t0:.1f} s ({where}, kernels {engine.client.kernel_backend}); "
          f"serving {names[0]} on http://{server_config.host}:{server_config.port}", file=sys.stderr, flush=True)
    timeout = server_config.shutdown_timeout
    # NOTE: uvicorn's own drain timeout is a backstop; ours ends the requests first, cleanly.
    uv_config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=5,
                               timeout_graceful_shutdown=timeout + 5.0)
    server = make_server(uv_config, timeout, lambda: _end_in_flight(engine, timeout))
    server.run(sockets=[sock])


def _make_metrics(engine: Any, name: str) -> Any:
    """``ServerMetrics`` for one engine; ``DataParallelMetrics`` (an ``engine`` label) for several."""
    from tandem.server.metrics import DataParallelMetrics, ServerMetrics

    def one(e: Any, process: bool = True) -> ServerMetrics:
        return ServerMetrics(name, core_pid=lambda: e.client.pid if e.is_healthy else None,
                             instance_id=e.instance_id, kernel_backend=e.client.kernel_backend, process=process)

    if hasattr(engine, "engines"):
        return DataParallelMetrics([one(e, process=False) for e in engine.engines])
    return one(engine)


def _end_in_flight(engine: Any, timeout: float) -> None:
    count = engine.end_all("the server is shutting down")
    if count:
        logger.warning("shutdown timeout (%.1f s) reached: ended %d request(s) still running", timeout, count)
