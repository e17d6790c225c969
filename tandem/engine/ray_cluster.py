"""The Ray cluster under ``--data-parallel-backend ray``, watched from the API server.

Ray ends a driver's process once its GCS has been unreachable for ``gcs_rpc_server_reconnect_timeout_s``
(60 s by default; ``rpc_client.h``: "Failed to connect to GCS within 60 seconds ... The program will
terminate", exit code 1, on stderr only): that is what a killed ``ray start --head`` (or a dead local head
of ``ray.init``) did to ``tandem serve``. ``ClusterWatch`` checks every second that the GCS accepts a TCP
connection; after ``cluster_lost_after_s`` without one it logs one ERROR naming the cluster, leaves it
(``ray.shutdown``, before Ray's own timeout) and marks it ``lost``: the engines stop using Ray and answer
503. With a ``rejoin`` action (a cluster joined at an address), it then waits for the GCS to answer again
and runs it (join, place and start the engine actors again); without one (a local cluster this server
started) the server must be restarted.

Leaving calls Ray's core worker, whose every call to its raylet that fails while the raylet is dead ends the
process at once, without a Python log (``raylet_ipc_client.cc``, ``ShutdownIfLocalRayletDisconnected``:
"Exiting because the Raylet IPC connection failed and the local Raylet is dead", ``QuickExit``). Ray thinks
the raylet dead when the process ``RAY_RAYLET_PID`` names is gone, or, unset (a driver), when this process's
parent is pid 1 (``getppid() == 1``: a server under systemd, tini or ``nohup ... &`` from a shell that
exited). Ray reads ``RAY_RAYLET_PID`` once, when ``ray`` is imported: ``import_ray`` sets it to this process's
own pid for that import, so no such call can end the server. Where ``ray`` was imported before (unguarded)
and leaving would end the process, the server logs the one ERROR and exits with code 1 itself instead.

A cluster this server started (``ray.init`` without an address) is never left through Ray: its raylet is a
child of this process, in its process group, and once it has exited (a signal to the whole group, the OOM
killer) every Ray call may wait on it without end. ``ClusterWatch`` checks it every second and, once it has
exited (or the GCS has not answered for ``cluster_lost_after_s``), stops the cluster's processes without a
Ray call (``stop_local``) and marks the cluster lost; ``RayEngines.close`` then ends the process at once.

Signals: ``ray.init`` sets a SIGTERM handler that exits with code 15 (and its local node one that exits with
1); ``deferred_signals`` keeps the server's own handlers and holds a SIGTERM/SIGINT that arrives meanwhile
until ``ray.init`` has returned. Ray's C++ failure-signal handler, installed with the driver's core worker,
resets SIGTERM to its default action when the core worker shuts down (``ray.shutdown``: a second SIGTERM
then killed the server with 143): ``import_ray`` turns it off for this process
(``RAY_DISABLE_FAILURE_SIGNAL_HANDLER``, read once at import, like ``RAY_RAYLET_PID``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0  # how often the GCS must accept a connection
LOST_AFTER_S = 10.0  # the cluster counts as lost after this long without (at most a third of Ray's timeout)
RAY_GCS_TIMEOUT_S = 60.0  # Ray's default gcs_rpc_server_reconnect_timeout_s: a driver exits after this
REJOIN_RETRY_S = 5.0  # pause after a failed rejoin
RAYLET_PID_ENV = "RAY_RAYLET_PID"  # the process Ray's core worker takes for its raylet (read at import)
NO_SIGNAL_HANDLER_ENV = "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"  # ray_constants: no C++ handlers (read at import)
EXIT_CLUSTER_LOST = 1  # exit code when the lost cluster cannot be left in-process (a supervisor restarts it)

_raylet_pid: str | None = None  # RAY_RAYLET_PID as Ray read it, when ``import_ray`` imported ray
_imported_here = False


def import_ray() -> Any:
    """Imports ``ray`` with ``RAY_RAYLET_PID`` set to this process's pid, so Ray's core worker never takes
    its raylet for dead and ends the process, and with ``RAY_DISABLE_FAILURE_SIGNAL_HANDLER=1``, so shutting
    Ray down does not reset SIGTERM to its default action (see the module doc); each unless set already,
    and restored afterwards (processes Ray starts do not inherit them). Changes: ``os.environ`` while
    importing.

    Raises: ImportError (ray is not installed).
    """
    global _raylet_pid, _imported_here
    if "ray" in sys.modules:
        import ray

        return ray
    saved = {name: os.environ.get(name) for name in (RAYLET_PID_ENV, NO_SIGNAL_HANDLER_ENV)}
    os.environ.setdefault(RAYLET_PID_ENV, str(os.getpid()))
    os.environ.setdefault(NO_SIGNAL_HANDLER_ENV, "1")
    try:
        import ray  # NOTE: Ray's C++ config (RayConfig) and ray_constants read both variables here, once
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
    _raylet_pid, _imported_here = saved[RAYLET_PID_ENV] or str(os.getpid()), True
    return ray


@contextlib.contextmanager
def deferred_signals(ray: Any, doing: str = "Ray starts",
                     then: str = "the server stops once ray.init has returned") -> Iterator[list[int]]:
    """Holds SIGTERM and SIGINT while the block runs (``ray.init``, or stopping the engine actors): the
    yielded list collects the signals that arrived (the first logs a WARNING: "SIGTERM while ``doing``:
    ``then``"), and Ray cannot set its own SIGTERM handlers meanwhile (``ray._private.utils
    .set_sigterm_handler`` does nothing inside). The handlers from before are set again on the way out;
    the caller acts on the list (a signal that arrived cut ``ray.init`` short before: exit code 15, and
    worker processes that outlived the server). Outside the main thread it changes nothing. Changes: the
    signal handlers, ``ray._private.utils.set_sigterm_handler`` inside the block."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    utils = getattr(getattr(ray, "_private", None), "utils", None)
    ray_setter = getattr(utils, "set_sigterm_handler", None)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def hold(signum: int, frame: Any) -> None:
        if not received:
            logger.warning("%s while %s: %s", signal.Signals(signum).name, doing, then)
        received.append(signum)

    for sig in before:
        signal.signal(sig, hold)
    if ray_setter is not None:
        utils.set_sigterm_handler = lambda handler: None
    try:
        yield received
    finally:
        if ray_setter is not None:
            utils.set_sigterm_handler = ray_setter
        for sig, handler in before.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ray_would_exit() -> bool:
    """Whether a failing call to a dead raylet would end this process (Ray's own test: the process named by
    ``RAY_RAYLET_PID`` as Ray read it is gone, or, unset, the parent is pid 1). No state changes."""
    pid = _raylet_pid if _imported_here else os.environ.get(RAYLET_PID_ENV)
    if pid:
        return not pid.isdigit() or not _pid_alive(int(pid))
    return os.getppid() == 1


def cluster_lost_after_s(environ: dict[str, str] | None = None) -> float:
    """Seconds without an answer from the GCS after which the server leaves the cluster: at most
    ``LOST_AFTER_S`` and at most a third of Ray's own ``RAY_gcs_rpc_server_reconnect_timeout_s`` (so the
    server leaves before Ray ends it; leaving takes about 5 s, in ``shutdown_driver``), at least one check
    interval. No state changes."""
    value = (os.environ if environ is None else environ).get("RAY_gcs_rpc_server_reconnect_timeout_s", "")
    try:
        ray_timeout_s = float(value) if value else RAY_GCS_TIMEOUT_S
    except ValueError:
        ray_timeout_s = RAY_GCS_TIMEOUT_S
    return max(CHECK_INTERVAL_S, min(LOST_AFTER_S, ray_timeout_s / 3))


def unreachable(address: str | None, timeout_s: float) -> str | None:
    """Why a plain ``HOST:PORT`` address refuses a TCP connection (None: it accepts one, or the address is
    another form: None, ``auto``, ``ray://...``). No state changes."""
    host, sep, port = (address or "").rpartition(":")
    if not sep or not port.isdigit() or not host or "/" in host:
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def reinstall_signal_handlers() -> None:
    """Sets SIGTERM's and SIGINT's Python handlers again at the C level (call in the main thread): Ray's
    ``shutdown_driver`` resets SIGTERM to its default action (the process would die at the next SIGTERM
    instead of shutting down gracefully)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        handler = signal.getsignal(sig)
        if handler is not None:
            signal.signal(sig, handler)


def exit_now(code: int) -> None:
    """Ends the process now with ``code`` (logs and standard streams flushed first): no Ray call may run
    on the way out."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


class ClusterWatch:
    """Watches the GCS at ``gcs_address`` in a daemon thread (``start`` / ``close``).

    Args:
        ray: the ``ray`` module. gcs_address: ``HOST:PORT`` of the cluster's GCS.
        rejoin: joins the cluster again and starts the engine actors (blocking; raises on failure); None:
            a lost cluster stays lost.
        local_exited: for a cluster this server started: whether its raylet has exited (checked every
            second). stop_local: stops that cluster's processes and the engine actors without a Ray call.
            With them, a lost local cluster is never left through Ray (``ray.shutdown`` would wait on the
            dead raylet).

    Attributes:
        lost: why the cluster counts as lost (None while it serves); Ray is not called meanwhile.
        orphaned: the local cluster was lost and stopped through ``stop_local``: no Ray call may run again,
            not even the interpreter's exit hooks (``RayEngines.close`` ends the process at once).
        lock: held by every Ray call of the server (``RayEngines``), so none runs while leaving.
        loop: the serving event loop, where the signal handlers are set again after leaving.
    """

    def __init__(self, ray: Any, gcs_address: str, rejoin: Callable[[], None] | None,
                 local_exited: Callable[[], bool] | None = None, stop_local: Callable[[], None] | None = None) -> None:
        self.ray = ray
        self.gcs_address = gcs_address
        self.rejoin = rejoin
        self.local_exited = local_exited
        self.stop_local = stop_local
        self.lost: str | None = None
        self.orphaned = False
        self.lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.num_rejoins = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-ray-cluster-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def close(self) -> None:
        """Stops watching (waits for the thread, e.g. for a rejoin under way). Idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        lost_after_s = cluster_lost_after_s()
        first_failure: float | None = None
        while not self._stop.wait(CHECK_INTERVAL_S):
            why = unreachable(self.gcs_address, CHECK_INTERVAL_S)
            if self.lost is not None:
                if why is None and self.rejoin is not None:
                    self._try_rejoin()
                continue
            if self.stop_local is not None and self.local_exited is not None and self.local_exited():
                self._orphan("the local Ray cluster's raylet has exited (a signal to the server's whole process "
                             "group, or the raylet was killed)")
                continue
            if why is None:
                first_failure = None
                continue
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            if now - first_failure >= lost_after_s:
                first_failure = None
                after = ("until the cluster is back (it then starts the engine actors again)" if self.rejoin
                         else "until it is restarted")
                self._leave(f"the Ray cluster at {self.gcs_address} is unreachable ({why}; for {lost_after_s:.0f} "
                            f"s): its engine actors are lost; the server answers 503 {after}")

    def _leave(self, reason: str) -> None:
        """Marks the cluster lost (one ERROR) and leaves it. Changes: ``lost``; Ray's connection. Where leaving
        would end the process (``ray_would_exit``) it exits with ``EXIT_CLUSTER_LOST`` after the ERROR instead.
        A local cluster (``stop_local``) is stopped without Ray instead (``_orphan``)."""
        if self.stop_local is not None:
            self._orphan(reason)
            return
        with self.lock:
            self.lost = reason
            if ray_would_exit():
                logger.error("%s; leaving the cluster would end this process silently (Ray's core worker exits when "
                             "it takes its raylet for dead: %s names no live process or, unset, the parent is pid 1): "
                             "exiting with code %d for a supervisor to restart the server", reason, RAYLET_PID_ENV,
                             EXIT_CLUSTER_LOST)
                exit_now(EXIT_CLUSTER_LOST)
                return
            logger.error("%s", reason)
            try:
                self.ray.shutdown()
            except Exception as e:  # noqa: BLE001 - leaving a dead cluster; nothing else to do
                logger.warning("leaving the lost Ray cluster: %s: %s", type(e).__name__, e)
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(reinstall_signal_handlers)

    def _orphan(self, reason: str) -> None:
        """Marks the local cluster lost and stops its processes without a Ray call (``stop_local``); one
        WARNING (the usual cause is a shutdown: a signal to the whole process group). Changes: ``lost``,
        ``orphaned``; processes."""
        self.lost = (f"{reason}: its engine actors are lost; the server answers 503 until it is restarted")
        self.orphaned = True  # NOTE: set before taking the lock: no Ray call starts from here on
        logger.warning("%s; stopping the cluster's processes and the engine actors without Ray calls", self.lost)
        with self.lock:
            self.stop_local()  # type: ignore[misc]

    def _try_rejoin(self) -> None:
        """Runs ``rejoin`` (the GCS answers again); on success the cluster serves again. Changes: ``lost``."""
        logger.warning("the Ray cluster at %s answers again: joining it and starting the engine actors",
                       self.gcs_address)
        t0 = time.monotonic()
        try:
            self.rejoin()  # type: ignore[misc]
        except Exception as e:  # noqa: BLE001 - any failure: leave again and retry later
            logger.warning("cannot rejoin the Ray cluster at %s yet: %s: %s", self.gcs_address, type(e).__name__, e)
            with self.lock:
                try:
                    self.ray.shutdown()
                except Exception:  # noqa: BLE001 - not joined
                    pass
            if self.loop is not None and not self.loop.is_closed():
                self.loop.call_soon_threadsafe(reinstall_signal_handlers)
            self._stop.wait(REJOIN_RETRY_S)
            return
        with self.lock:
            self.lost = None
        self.num_rejoins += 1
        logger.warning("rejoined the Ray cluster at %s: engine actors ready in %.1f s", self.gcs_address,
                       time.monotonic() - t0)
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(reinstall_signal_handlers)
