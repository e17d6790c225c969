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

When the cluster itself goes away (its head's GCS stops answering), ``ray_cluster.ClusterWatch`` leaves it
before Ray would end this process, and each engine whose connection drops answers 503
``engine_unavailable`` (with one engine per node, an engine on a node that still runs keeps serving until
Ray's own timeout ends it there). The actors went with the cluster (no GCS fault tolerance here): for a
cluster joined at an address (``--ray-address``, ``$RAY_ADDRESS``) the server joins it again once its GCS
answers and starts new actors, which the supervisors reconnect to (counted as restarts); a local cluster
this server started is not started again (the 503 is for good, the server must be restarted).

Importing this module does not import ray (``RayEngines`` does; ``pip install 'tandem[ray]'``).
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import functools
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
from tandem.engine.ray_cluster import ClusterWatch, deferred_signals, exit_now, import_ray, unreachable
from tandem.engine.remote_client import (
    RECONNECT_TIMEOUT_S,
    EngineCoreAwayError,
    EngineCoreGoneError,
    RemoteCoreSupervisor,
    RemoteEngineCoreClient,
)

logger = logging.getLogger(__name__)

RAY_MAX_RESTARTS = 10  # Ray restarts a dead engine actor this many times (then the server answers 503)
PLACEMENT_TIMEOUT_S = 120.0  # the cluster must find CPUs for every bundle within this
JOIN_CONNECT_TIMEOUT_S = 10.0  # a head address must accept a TCP connection within this
LOAD_TIMEOUT_S = 600.0  # every actor must have loaded its model within this
LOSS_PROBES = 2  # a lost connection checks the GCS this often before it counts as an actor's death (an ERROR)
LOSS_PROBE_INTERVAL_S = 1.0
LOSS_PROBE_TIMEOUT_S = 1.0
RAYLET_PROCESS = "raylet"  # ray_constants.PROCESS_TYPE_RAYLET: the key of Node.all_processes
CLOSE_TIMEOUT_S = 30.0  # leaving a local cluster (about 4 s) may take this long before its processes are killed
CLOSE_POLL_S = 0.2  # how often close checks that the local raylet still runs


class RayCoreSupervisor(RemoteCoreSupervisor):
    """``RemoteCoreSupervisor`` whose reconnects are restarts: a Ray engine actor that drops its
    connection has usually died and been restarted by Ray, so a reconnect to a new process is counted
    (``num_restarts``, ``on_restart``) with the time from the loss to the reconnect (``last_restart_s``).
    A reconnect to the same process (the pid and host of its ``Ready``: an actor starved past the
    heartbeat timeout on a busy machine, not restarted) is logged but not counted, and its cache is kept.
    A lost connection is an ERROR only while the cluster's GCS answers (``_report_loss``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reports: set[asyncio.Task] = set()

    def watch(self) -> None:
        engines = getattr(self.start_core, "engines", None)
        if engines is not None and engines.cluster is not None:
            engines.cluster.loop = asyncio.get_running_loop()  # NOTE: where the signal handlers are set again
            self.client.report_loss = functools.partial(self._report_loss, engines.cluster)
        super().watch()

    def _report_loss(self, cluster: ClusterWatch, reason: str) -> None:
        """Logs a lost connection: a WARNING when the cluster's GCS does not answer either (the cluster watch
        logs the one ERROR for the whole cluster), else an ERROR (an actor died; Ray restarts it)."""
        if cluster.lost is not None:
            logger.warning("%s (the Ray cluster is lost)", reason)
            return
        task = asyncio.get_running_loop().create_task(self._report_after_probe(cluster, reason))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _report_after_probe(self, cluster: ClusterWatch, reason: str) -> None:
        for attempt in range(LOSS_PROBES):
            why = await asyncio.to_thread(unreachable, cluster.gcs_address, LOSS_PROBE_TIMEOUT_S)
            if why is not None or cluster.lost is not None:
                logger.warning("%s; the Ray cluster at %s does not answer either (%s): the cluster watch decides",
                               reason, cluster.gcs_address, why or "lost")
                return
            if attempt + 1 < LOSS_PROBES:
                await asyncio.sleep(LOSS_PROBE_INTERVAL_S)  # NOTE: the head's processes may die a moment later
        logger.error("%s", reason)

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


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


AUTH_HINT = ("a cluster made by `ray start --head` uses token authentication by default in recent Ray "
             "(2.60 here): run this server and `ray start --address` on the other nodes with RAY_AUTH_MODE=token "
             "and the head's token (its ~/.ray/auth_token copied to the same path, or RAY_AUTH_TOKEN); "
             "or start the head with RAY_AUTH_MODE=disabled")


def _unreachable(address: str | None, timeout_s: float = JOIN_CONNECT_TIMEOUT_S) -> str | None:
    """Why a plain ``HOST:PORT`` head address refuses a TCP connection (``ray_cluster.unreachable``); Ray's
    own ``init`` retries such an address without end. No state changes."""
    return unreachable(address, timeout_s)


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
            ray = import_ray()
        except ImportError:
            raise ValueError("--data-parallel-backend ray needs Ray: pip install 'tandem[ray]'") from None
        self.ray = ray
        self.model_dir = Path(model_dir).absolute()  # NOTE: actors run in another working directory
        self.dp = parallel.data_parallel_size
        self.log_level = log_level
        self.secret = secrets.token_hex(32).encode()  # NOTE: per server; only its actors learn it
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            # NOTE: ray.init sets a SIGTERM handler that exits with code 15; the server's own (a graceful
            # shutdown, exit code 0) must stay, and a signal during ray.init acts once it has returned.
            with deferred_signals(ray) as received:
                _join(ray, parallel.ray_address)
            if received:
                ray.shutdown()
                signal.raise_signal(received[0])  # NOTE: the server's own handler acts on it (SystemExit(0))
                raise SystemExit(0)  # NOTE: a handler that did not end the start-up: Ray is gone all the same
        cpus = config.num_threads or max(1, int(ray.cluster_resources().get("CPU", 1)) // self.dp)
        # NOTE: Ray places the actor; pinning to core ids here would be guesswork about its node.
        self.config = dataclasses.replace(config, num_threads=cpus, cpu_bind="none")
        self.cpus = cpus
        self.actors: list[Any] = []
        self.addresses: list[str] = []
        self.actor_pids: list[tuple[str | None, int | None]] = []  # (host, pid) of each actor's process, as it reported
        self.group = None
        # NOTE: a cluster this server started (ray.init without an address) is not started again once lost
        self.rejoins = bool(parallel.ray_address or os.environ.get("RAY_ADDRESS"))
        self.cluster: ClusterWatch | None = None  # from ``wait`` on

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
        self.actor_pids = [(c.core_host, c.core_pid) for c in clients]
        local = self._local_node() is not None
        self.cluster = ClusterWatch(ray, ray.get_runtime_context().gcs_address, self._rejoin if self.rejoins else None,
                                    self._local_raylet_exited if local else None,
                                    self._stop_orphaned_local_cluster if local else None)
        self.cluster.start()
        return clients

    def _rejoin(self) -> None:
        """Joins the cluster again and starts new engine actors (the old ones went with the lost cluster),
        blocking until each has loaded its model (``ClusterWatch`` runs it once the GCS answers again).

        Raises: ValueError (cannot join), EngineCoreStartError (cannot place or load the actors), RayError.
        """
        ray = self.ray
        _join(ray, self.cluster.gcs_address)
        self.actors, self.group = [], None
        try:
            self.start()
            refs = [a.address.remote() for a in self.actors]
            deadline = time.monotonic() + LOAD_TIMEOUT_S
            while len(ray.wait(refs, num_returns=len(refs), timeout=1.0)[0]) < len(refs):
                if self.cluster.stopping or time.monotonic() > deadline:
                    raise EngineCoreStartError("the engine core actors did not load (stopping or timed out)")
            addresses = ray.get(refs)
        except BaseException:
            self._kill_actors()
            raise
        self.addresses = addresses

    def restarter(self, rank: int) -> Any:
        """Reconnects to actor ``rank`` at its (possibly new) address; raises EngineCoreStartError while
        Ray is still restarting it (the supervisor retries every second), while the cluster is lost
        EngineCoreAwayError (it will be joined again) or EngineCoreGoneError (it will not: the supervisor
        stops)."""

        def reconnect() -> RemoteEngineCoreClient:
            ray, cluster = self.ray, self.cluster
            with cluster.lock:
                if cluster.lost is not None:
                    raise (EngineCoreAwayError if cluster.rejoin else EngineCoreGoneError)(cluster.lost)
                try:
                    address = ray.get(self.actors[rank].address.remote(), timeout=RECONNECT_TIMEOUT_S)
                except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
                    raise EngineCoreStartError(f"engine core actor {rank} is not back yet: "
                                               f"{type(e).__name__}") from None
            self.addresses[rank] = address
            client = RemoteEngineCoreClient.connect(address, self.secret, RECONNECT_TIMEOUT_S)
            if rank < len(self.actor_pids):
                self.actor_pids[rank] = (client.core_host, client.core_pid)
            return client

        reconnect.engines = self  # type: ignore[attr-defined]  # NOTE: for RayCoreSupervisor.watch
        return reconnect

    def pids(self) -> list[int]:
        """The actors' process ids (for tests and operators)."""
        return self.ray.get([a.pid.remote() for a in self.actors], timeout=30)

    def _kill_actors(self) -> None:
        ray = self.ray
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.group)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def describe(self) -> str:
        return f"Ray actors at {', '.join(self.addresses)}, {self.cpus} CPU(s) each"

    def close(self) -> None:
        """Kills the actors (no restart), removes the placement group, and leaves the cluster (nothing
        once the cluster is lost: it is left already).

        When this server started the local cluster, a SIGTERM to the server's whole process group
        (systemd's default ``KillMode=control-group``, ``kill -TERM -- -PGID``) ends its raylet too, and
        Ray's calls then wait on it without end (``remove_placement_group`` did). So the raylet is checked
        first and, while the calls run, by ``_CloseWatch``: once it has exited (or after
        ``CLOSE_TIMEOUT_S``) the cluster's processes and the actors are killed directly
        (``_stop_orphaned_local_cluster``) and the process exits with code 0 at once (the server has
        drained; a normal exit would run Ray's core worker teardown, which crashed with SIGSEGV then).
        A SIGTERM or SIGINT meanwhile is logged and changes nothing (it killed the server with 143 before)."""
        logger.info("stopping the Ray engine actors")
        with deferred_signals(self.ray, "the Ray engine actors stop", "the server exits once they have"):
            self._close()

    def _close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
            if self.cluster.orphaned:
                exit_now(0)  # NOTE: the local cluster is stopped already; see below for why no normal exit
            if self.cluster.lost is not None:
                return
        if self._local_raylet_exited():
            logger.warning("the local Ray cluster's raylet has exited (a signal to the server's whole process "
                           "group?): stopping its processes and the engine actors without Ray calls")
            self._stop_orphaned_local_cluster()
            exit_now(0)  # NOTE: a normal exit runs Ray's core worker teardown, which crashed (SIGSEGV) here
        watch = _CloseWatch(self) if self._local_node() is not None else None
        try:
            self._kill_actors()
            if watch is not None:
                watch.shutting_down = True  # NOTE: ray.shutdown kills the raylet itself
            if self.started_ray or self.cluster is not None and self.cluster.num_rejoins:
                self.ray.shutdown()
        finally:
            if watch is not None:
                watch.stop()

    def _local_node(self) -> Any:
        """Ray's record of the local cluster ``ray.init`` started in this process (None: none, or a
        cluster joined at an address)."""
        if not self.started_ray or self.rejoins:
            return None
        worker = getattr(getattr(self.ray, "_private", None), "worker", None)
        return getattr(worker, "_global_node", None)

    def _local_raylet_exited(self) -> bool:
        """Whether this server started the local cluster and that cluster's raylet has exited. No state changes."""
        node = self._local_node()
        if node is None:
            return False
        try:
            return any(kind == RAYLET_PROCESS for kind, _ in node.dead_processes())
        except Exception:  # noqa: BLE001 - Ray's internals moved: keep the normal path
            return False

    def _stop_orphaned_local_cluster(self) -> None:
        """Ends a local cluster whose raylet is gone without one Ray call: SIGKILL to each engine actor's
        process on this host (its recorded pid, if that process is still a Ray worker), then to the
        cluster's other processes (GCS, monitors; Ray's own ``kill_all_processes``, which reaps them), and
        drops Ray's exit hook, whose ``ray.shutdown`` would wait on the raylet too. Changes: processes."""
        host = socket.gethostname()
        for actor_host, pid in self.actor_pids:
            if pid is not None and actor_host in (None, host) and _is_ray_worker(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        node = self._local_node()
        try:
            node.kill_all_processes(check_alive=False, allow_graceful=False)
        except Exception as e:  # noqa: BLE001 - best effort on the way out
            logger.warning("stopping the local Ray processes: %s: %s", type(e).__name__, e)
        atexit.unregister(self.ray.shutdown)
        atexit.unregister(self.ray._private.worker.shutdown)


class _CloseWatch:
    """A daemon thread that ends the process once ``engines``' local raylet exits while ``close`` waits on
    Ray (or after ``CLOSE_TIMEOUT_S``), after stopping the cluster without Ray (``_stop_orphaned_local_cluster``).
    ``shutting_down``: ``ray.shutdown`` runs (it ends the raylet itself): only the deadline counts then."""

    def __init__(self, engines: RayEngines) -> None:
        self.engines = engines
        self.shutting_down = False
        self._deadline = time.monotonic() + CLOSE_TIMEOUT_S
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-ray-close-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(CLOSE_POLL_S):
            late = time.monotonic() > self._deadline
            if late or not self.shutting_down and self.engines._local_raylet_exited():
                if self._stop.is_set():
                    return
                logger.warning("%s: stopping its processes and the engine actors without Ray calls",
                               f"leaving the local Ray cluster took over {CLOSE_TIMEOUT_S:.0f} s" if late else
                               "the local Ray cluster's raylet has exited (a signal to the server's whole "
                               "process group?)")
                self.engines._stop_orphaned_local_cluster()
                exit_now(0)
                return


def _is_ray_worker(pid: int) -> bool:
    """Whether process ``pid`` is a Ray worker (its title starts with ``ray::``), so a reused pid is never killed."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().startswith(b"ray::")
    except OSError:
        return False
