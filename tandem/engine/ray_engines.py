"""Engine cores as Ray actors (``tandem serve -dp N --data-parallel-backend ray``).

Each engine core is one ``EngineCoreActor`` in a placement group with one bundle of CPUs per engine
(strategy SPREAD: on different nodes where the cluster has room, packed otherwise). The actor loads
the model and serves it as ``tandem engine`` does (``core_service.EngineCoreService``, a ROUTER
socket on its node's IP and a free port, behind the HMAC handshake with a secret made for this
server), in a thread of the actor's process. The API server connects to each actor's address with
``RemoteEngineCoreClient``. When an actor's process dies, Ray restarts it (``max_restarts``); the
server notices the lost connection (in-flight requests end with 503), asks the restarted actor for
its new address and reconnects (``RayCoreSupervisor``, which counts the restart in
``tandem:engine_core_restarts_total``).

When the cluster itself goes away (its head's GCS stops answering: ``ray start --head`` killed, the local
head of ``ray.init`` dead), Ray ends the server's process once its GCS is unreachable for
``gcs_rpc_server_reconnect_timeout_s`` (60 s by default; ``rpc_client.h``: "Failed to connect to GCS within
60 seconds ... The program will terminate", exit code 1, on stderr only). ``RayEngines`` instead checks
the GCS address every second; after ``cluster_lost_after_s`` without an answer it logs one ERROR naming the
cluster, leaves it (``ray.shutdown``, before Ray's own timeout) and stops reconnecting: each engine whose
connection drops then answers 503 ``engine_unavailable`` for good (with one engine per node, an engine on
a node that still runs keeps serving until Ray's own timeout ends it there). The actors are gone with the
cluster (no GCS fault tolerance here), so a server whose cluster came back must be restarted.

Importing this module does not import ray (``RayEngines`` does; ``pip install 'tandem[ray]'``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from tandem.config import EngineConfig, ParallelConfig
from tandem.engine.core_client import EngineCoreStartError
from tandem.engine.remote_client import (
    RECONNECT_TIMEOUT_S,
    EngineCoreGoneError,
    RemoteCoreSupervisor,
    RemoteEngineCoreClient,
)

logger = logging.getLogger(__name__)

RAY_MAX_RESTARTS = 10  # Ray restarts a dead engine actor this many times (then the server answers 503)
PLACEMENT_TIMEOUT_S = 120.0  # the cluster must find CPUs for every bundle within this
JOIN_CONNECT_TIMEOUT_S = 10.0  # a head address must accept a TCP connection within this
LOAD_TIMEOUT_S = 600.0  # every actor must have loaded its model within this
CLUSTER_CHECK_INTERVAL_S = 1.0  # how often the server checks that the cluster's GCS accepts a connection
CLUSTER_LOST_AFTER_S = 10.0  # the cluster counts as lost after this long without (at most a third of Ray's)
RAY_GCS_TIMEOUT_S = 60.0  # Ray's default gcs_rpc_server_reconnect_timeout_s: a driver exits after this


def cluster_lost_after_s(environ: dict[str, str] | None = None) -> float:
    """Seconds without an answer from the GCS after which the server leaves the cluster: at most
    ``CLUSTER_LOST_AFTER_S`` and at most a third of Ray's own ``RAY_gcs_rpc_server_reconnect_timeout_s``
    (so the server leaves before Ray ends it), at least one check interval. No state changes."""
    value = (os.environ if environ is None else environ).get("RAY_gcs_rpc_server_reconnect_timeout_s", "")
    try:
        ray_timeout_s = float(value) if value else RAY_GCS_TIMEOUT_S
    except ValueError:
        ray_timeout_s = RAY_GCS_TIMEOUT_S
    return max(CLUSTER_CHECK_INTERVAL_S, min(CLUSTER_LOST_AFTER_S, ray_timeout_s / 3))


class RayCoreSupervisor(RemoteCoreSupervisor):
    """``RemoteCoreSupervisor`` whose reconnects are restarts: a Ray engine actor that drops its
    connection has usually died and been restarted by Ray, so a reconnect to a new process is counted
    (``num_restarts``, ``on_restart``) with the time from the loss to the reconnect (``last_restart_s``).
    A reconnect to the same process (the pid and host of its ``Ready``: an actor starved past the
    heartbeat timeout on a busy machine, not restarted) is logged but not counted, and its cache is kept."""

    def watch(self) -> None:
        super().watch()
        engines = getattr(self.start_core, "engines", None)
        if engines is not None:
            engines.loop = asyncio.get_running_loop()  # NOTE: where RayEngines restores the signal handlers

    async def _restart(self) -> None:
        t0, old = time.monotonic(), self.client
        before = (getattr(old, "core_pid", None), getattr(old, "core_host", None))
        await super()._restart()
        if self.client is old or self._closing:
            return
        if before[0] is not None and (self.client.core_pid, self.client.core_host) == before:
            logger.warning("engine core actor reconnected in %.2f s: the same process (pid %d on %s), not a restart",
                           time.monotonic() - t0, before[0], before[1])
            return
        self.num_restarts += 1
        self.last_restart_s = time.monotonic() - t0
        logger.warning("engine core actor back in %.2f s (restart %d)", self.last_restart_s, self.num_restarts)
        if self.on_restart is not None:
            self.on_restart()


class ActorEngine:
    """What an ``EngineCoreActor`` runs: one engine core served on ``tcp://<node ip>:<free port>`` in a
    daemon thread. Blocks in ``__init__`` until the model is loaded.

    Raises:
        RuntimeError: the engine failed to load (its message).
    """

    def __init__(self, model_dir: str, config: EngineConfig, secret: bytes, rank: int, host: str) -> None:
        self.rank = rank
        self.address = ""
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(Path(model_dir), config, secret, host),
                                        name=f"tandem-engine-{rank}", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"engine core {rank} failed to start: {self._error}") from self._error

    def _serve(self, model_dir: Path, config: EngineConfig, secret: bytes, host: str) -> None:
        import zmq

        from tandem.engine.core import EngineCore
        from tandem.engine.core_proc import make_ready
        from tandem.engine.core_service import EngineCoreService as Service
        from tandem.engine.core_service import bind_router
        from tandem.engine.handshake import PeerGate
        from tandem.kv_cache.events import KVEventPublisher

        ctx = zmq.Context()
        try:
            address = f"tcp://{host}:{_free_port(host)}"
            sock = bind_router(ctx, address)
            publisher = KVEventPublisher.from_config(config.kv_events, self.rank) if config.kv_events else None
            core = EngineCore(model_dir, config, progress=False)
            ready = make_ready(core, config, publisher, model_dir.name, core.runner.hf_config.vocab_size)
            service = Service(core, sock, PeerGate(secret), ready, config.scheduler.max_queue_len, publisher,
                              str(self.rank))
        except BaseException as e:
            self._error = e
            self._ready.set()
            ctx.term()
            return
        self.address = address
        self._ready.set()
        logger.info("engine core %d (pid %d) serving on %s", self.rank, os.getpid(), address)
        service.run()


def _reinstall_signal_handlers() -> None:
    """Sets SIGTERM's and SIGINT's Python handlers again at the C level (call in the main thread)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        handler = signal.getsignal(sig)
        if handler is not None:
            signal.signal(sig, handler)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


AUTH_HINT = ("a cluster made by `ray start --head` uses token authentication by default in recent Ray "
             "(2.60 here): run this server and `ray start --address` on the other nodes with RAY_AUTH_MODE=token "
             "and the head's token (its ~/.ray/auth_token copied to the same path, or RAY_AUTH_TOKEN); "
             "or start the head with RAY_AUTH_MODE=disabled")


def _unreachable(address: str | None, timeout_s: float = JOIN_CONNECT_TIMEOUT_S) -> str | None:
    """Why a plain ``HOST:PORT`` head address refuses a TCP connection (None: it accepts one, or the
    address is another form: None, ``auto``, ``ray://...``). Ray's own ``init`` retries such an address
    without end. No state changes."""
    host, sep, port = (address or "").rpartition(":")
    if not sep or not port.isdigit() or not host or "/" in host:
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def _join(ray: Any, address: str | None) -> None:
    """``ray.init`` at ``address`` (None: ``$RAY_ADDRESS``, a running local cluster, else a new one).

    Raises:
        ValueError: the cluster cannot be joined (Ray's reason; with how to pass its token when this
            process does not send one, the most common cause with a CLI-made cluster).
    """
    unreachable = _unreachable(address)
    if unreachable is not None:
        raise ValueError(f"cannot join the Ray cluster at {address}: nothing answers there ({unreachable}); start "
                         "its head with `ray start --head --port PORT` or pass the address it printed")
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    except (ConnectionError, RuntimeError) as e:
        hint = "" if os.environ.get("RAY_AUTH_MODE") == "token" else f"; {AUTH_HINT}"
        raise ValueError(f"cannot join the Ray cluster at {address or 'the default address'}: {e}{hint}") from None


def _actor_class() -> Any:
    import ray

    @ray.remote
    class EngineCoreActor:
        """A Ray actor holding one ``ActorEngine``."""

        def __init__(self, model_dir: str, config: EngineConfig, secret: bytes, rank: int, log_level: str) -> None:
            logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            self.service = ActorEngine(model_dir, config, secret, rank, ray.util.get_node_ip_address())

        def address(self) -> str:
            return self.service.address

        def pid(self) -> int:
            return os.getpid()

    return EngineCoreActor


class RayEngines:
    """Places ``parallel.data_parallel_size`` engine actors on a Ray cluster and connects to them.

    Args:
        model_dir: the model folder, at the same path on every node (a relative one is made absolute here).
        config: each engine's config (threads: ``num_threads``, default the cluster's CPUs / N).
        parallel: ``data_parallel_size`` and ``ray_address`` (None: ``ray.init``'s default).

    Raises:
        ValueError: ray is not installed, or the cluster cannot be joined (``_join``).
    """

    supervisor_cls = RayCoreSupervisor

    def __init__(self, model_dir: Path, config: EngineConfig, parallel: ParallelConfig, log_level: str) -> None:
        try:
            import ray
        except ImportError:
            raise ValueError("--data-parallel-backend ray needs Ray: pip install 'tandem[ray]'") from None
        self.ray = ray
        self.model_dir = Path(model_dir).absolute()  # NOTE: actors run in another working directory
        self.dp = parallel.data_parallel_size
        self.log_level = log_level
        self.secret = secrets.token_hex(32).encode()  # NOTE: per server; only its actors learn it
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            handler = signal.getsignal(signal.SIGTERM)
            _join(ray, parallel.ray_address)
            if handler is not None and threading.current_thread() is threading.main_thread():
                # NOTE: ray.init sets a SIGTERM handler that exits with code 15; the server's own (a graceful
                # shutdown, exit code 0) must stay.
                signal.signal(signal.SIGTERM, handler)
        cpus = config.num_threads or max(1, int(ray.cluster_resources().get("CPU", 1)) // self.dp)
        # NOTE: Ray places the actor; pinning to core ids here would be guesswork about its node.
        self.config = dataclasses.replace(config, num_threads=cpus, cpu_bind="none")
        self.cpus = cpus
        self.actors: list[Any] = []
        self.addresses: list[str] = []
        self.group = None
        self.lost: str | None = None  # why the cluster counts as lost (then Ray is not used any more)
        self._ray_lock = threading.Lock()  # NOTE: no Ray call may run while the watch leaves the cluster
        self._stop = threading.Event()
        self._watch: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the serving loop (set by RayCoreSupervisor.watch)

    def start(self) -> None:
        """Creates the placement group and the actors (which load the model meanwhile).

        Raises:
            EngineCoreStartError: the cluster cannot place the bundles.
        """
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.ray
        self.group = placement_group([{"CPU": self.cpus}] * self.dp, strategy="SPREAD")
        try:
            ray.get(self.group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise EngineCoreStartError(f"the Ray cluster cannot place {self.dp} engine cores of {self.cpus} CPU(s) "
                                       f"each within {PLACEMENT_TIMEOUT_S:.0f} s ({ray.cluster_resources()})") from None
        actor = _actor_class()
        for rank in range(self.dp):
            strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank)
            self.actors.append(actor.options(num_cpus=self.cpus, max_restarts=RAY_MAX_RESTARTS, max_task_retries=0,
                                             scheduling_strategy=strategy).remote(
                str(self.model_dir), self.config, self.secret, rank, self.log_level))

    def wait(self) -> list[RemoteEngineCoreClient]:
        """Waits for every actor's model and connects to each (the front end must then attach soon:
        a connected core drops a silent front end after ``handshake.PEER_TIMEOUT_S``).

        Raises:
            EngineCoreStartError: an actor failed, or a connection failed.
        """
        ray = self.ray
        try:
            self.addresses = ray.get([a.address.remote() for a in self.actors], timeout=LOAD_TIMEOUT_S)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            raise EngineCoreStartError(f"an engine core actor failed to start: {e}") from None
        clients: list[RemoteEngineCoreClient] = []
        try:
            for address in self.addresses:
                clients.append(RemoteEngineCoreClient.connect(address, self.secret))
        except BaseException:
            for client in clients:
                client.close()
            raise
        self._watch = threading.Thread(target=self._watch_cluster, args=(ray.get_runtime_context().gcs_address,),
                                       name="tandem-ray-cluster-watch", daemon=True)
        self._watch.start()
        return clients

    def _watch_cluster(self, gcs_address: str) -> None:
        """Checks every ``CLUSTER_CHECK_INTERVAL_S`` that the GCS at ``gcs_address`` accepts a TCP
        connection; after ``cluster_lost_after_s()`` of refusals (or timeouts) the cluster is lost:
        ``lost`` is set, one ERROR logged and the cluster left (``ray.shutdown``: Ray would otherwise end
        this process; NOTE: leaving takes about 5 s, in ``shutdown_driver``). Runs in its own thread until
        ``close``. Changes: ``lost``; Ray's connection."""
        lost_after_s = cluster_lost_after_s()
        first_failure: float | None = None
        while not self._stop.wait(CLUSTER_CHECK_INTERVAL_S):
            why = _unreachable(gcs_address, CLUSTER_CHECK_INTERVAL_S)
            if why is None:
                first_failure = None
                continue
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            if now - first_failure >= lost_after_s:
                self._leave(f"the Ray cluster at {gcs_address} is unreachable ({why}; for {lost_after_s:.0f} s): its "
                            "engine actors are lost; the server answers 503 until it is restarted (once the cluster "
                            "is back)")
                return

    def _leave(self, reason: str) -> None:
        with self._ray_lock:
            self.lost = reason
            logger.error("%s", reason)
            try:
                self.ray.shutdown()
            except Exception as e:  # noqa: BLE001 - leaving a dead cluster; nothing else to do
                logger.warning("leaving the lost Ray cluster: %s: %s", type(e).__name__, e)
        # NOTE: Ray's shutdown_driver resets SIGTERM to its default action (the process would die at the next
        # SIGTERM instead of shutting down gracefully): the handlers are set again, from the main thread.
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(_reinstall_signal_handlers)

    def restarter(self, rank: int) -> Any:
        """Reconnects to actor ``rank`` at its (possibly new) address; raises EngineCoreStartError while
        Ray is still restarting it (the supervisor retries every second), EngineCoreGoneError once the
        cluster is lost (the supervisor stops)."""

        def reconnect() -> RemoteEngineCoreClient:
            ray = self.ray
            with self._ray_lock:
                if self.lost is not None:
                    raise EngineCoreGoneError(self.lost)
                try:
                    address = ray.get(self.actors[rank].address.remote(), timeout=RECONNECT_TIMEOUT_S)
                except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
                    raise EngineCoreStartError(f"engine core actor {rank} is not back yet: "
                                               f"{type(e).__name__}") from None
            self.addresses[rank] = address
            return RemoteEngineCoreClient.connect(address, self.secret, RECONNECT_TIMEOUT_S)

        reconnect.engines = self  # type: ignore[attr-defined]  # NOTE: for RayCoreSupervisor.watch
        return reconnect

    def pids(self) -> list[int]:
        """The actors' process ids (for tests and operators)."""
        return self.ray.get([a.pid.remote() for a in self.actors], timeout=30)

    def describe(self) -> str:
        return f"Ray actors at {', '.join(self.addresses)}, {self.cpus} CPU(s) each"

    def close(self) -> None:
        """Kills the actors (no restart), removes the placement group, and leaves the cluster (nothing
        once the cluster is lost: it is left already)."""
        self._stop.set()
        if self._watch is not None:
            self._watch.join()
        if self.lost is not None:
            return
        ray = self.ray
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
        if self.started_ray:
            ray.shutdown()
