"""Supervision of the engine-core process: notice its death, restart it, stop on a crash loop.

``CoreSupervisor`` owns the current ``EngineCoreClient``. When the core dies (its process exits, or
it reports ``CoreFailed`` before exiting), ``on_lost`` runs once (the front end ends every in-flight
request with ``EngineDeadError``), then a new core is started in a worker thread while new requests
get 503 with ``Retry-After``; once it is ready ``on_ready`` runs with the new client. A core that dies
``restart_limit`` times within ``restart_window_s`` seconds is not started again (crash loop): the
server answers 503 until an operator restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from tandem.engine.core_client import EngineCoreClient, EngineCoreStartError
from tandem.errors import EngineDeadError

logger = logging.getLogger(__name__)

RESTART_RETRY_AFTER_S = 2.0  # Retry-After of a 503 while the core restarts


class CrashLoopGuard:
    """Counts core deaths; the ``limit``-th death within ``window_s`` seconds ends the restarts.

    ``limit`` 1 never restarts. Changes: the remembered death times.
    """

    def __init__(self, limit: int = 3, window_s: float = 60.0) -> None:
        if limit < 1 or window_s <= 0:
            raise ValueError(f"need limit >= 1 and window_s > 0, got {limit}, {window_s}")
        self.limit = limit
        self.window_s = window_s
        self._deaths: deque[float] = deque()

    def record_death(self, now: float) -> bool:
        """Records a death at ``now`` (monotonic seconds). Returns True when a restart is allowed."""
        self._deaths.append(now)
        while self._deaths and now - self._deaths[0] > self.window_s:
            self._deaths.popleft()
        return len(self._deaths) < self.limit

    @property
    def recent_deaths(self) -> int:
        return len(self._deaths)


class CoreSupervisor:
    """Keeps one engine core serving. Use from the event loop.

    Args:
        client: the started (ready) core.
        start_core: starts and waits for a new core (blocking; run in a thread); None = no restarts.
        guard: the crash-loop rule.
        on_lost: called with the error for in-flight requests, once per dead core.
        on_ready: called with the new client once a restarted core is ready.
        on_restart: called after each successful restart (metrics).
    """

    def __init__(
        self, client: EngineCoreClient, start_core: Callable[[], EngineCoreClient] | None,
        guard: CrashLoopGuard, on_lost: Callable[[EngineDeadError], None],
        on_ready: Callable[[EngineCoreClient], None], on_restart: Callable[[], None] | None = None,
    ) -> None:
        self.client = client
        self.start_core = start_core
        self.guard = guard
        self.on_lost = on_lost
        self.on_ready = on_ready
        self.on_restart = on_restart
        self.unavailable: EngineDeadError | None = None  # None while a core serves
        self.permanent = False
        self.num_restarts = 0
        self.last_restart_s: float | None = None
        self._task: asyncio.Task | None = None
        self._closing = False

    def watch(self) -> None:
        """Starts watching the current client's process (call on the running loop)."""
        client = self.client
        client.attach(lambda: self.core_died(client, self._exit_reason(client)))

    @staticmethod
    def _exit_reason(client: EngineCoreClient) -> str:
        logger.error("the engine core process (pid %s) exited with code %s", client.pid, client.proc.exitcode)
        return "the engine core process died"

    def core_died(self, client: EngineCoreClient, reason: str) -> None:
        """Handles the death of ``client``'s core (idempotent; stale clients are ignored): fails the
        in-flight requests, then restarts the core or, in a crash loop, gives up for good."""
        if client is not self.client or self.unavailable is not None or self._closing:
            return
        self._after_death(reason)
        # NOTE: after deciding whether a new core comes, so in-flight requests that end with 503 carry the
        # same Retry-After as new ones (none when the core will not come back).
        retry_after = self.unavailable.retry_after if self.unavailable is not None else None
        self.on_lost(EngineDeadError(reason, retry_after))

    def _after_death(self, reason: str) -> None:
        if self.start_core is None or not self.guard.record_death(time.monotonic()):
            self._give_up(reason)
            return
        self.unavailable = EngineDeadError("the engine core is restarting; retry shortly", RESTART_RETRY_AFTER_S)
        logger.warning("restarting the engine core (%s)", reason)
        self._task = asyncio.get_running_loop().create_task(self._restart(), name="tandem-core-restart")

    def _give_up(self, reason: str) -> None:
        self.permanent = True
        if self.start_core is None or self.guard.limit == 1:
            message = f"{reason}; it is not restarted (restarts are off)"
        else:
            message = (f"{reason}; it died {self.guard.recent_deaths} times within {self.guard.window_s:.0f} s "
                       "(crash loop), so it is not restarted")
        self.unavailable = EngineDeadError(message)
        logger.error("%s: the server answers 503 until it is restarted", message)

    async def _restart(self) -> None:
        t0 = time.monotonic()
        await self._retire(self.client)
        try:
            new = await asyncio.to_thread(self.start_core)
        except EngineCoreStartError as e:
            logger.error("the engine core failed to restart: %s", e)
            if not self._closing:
                self._after_death(f"the engine core failed to restart: {e}")
            return
        if not await self._adopt(new):
            return
        self.num_restarts += 1
        self.last_restart_s = time.monotonic() - t0
        logger.warning("engine core restarted in %.2f s (pid %s, restart %d)", self.last_restart_s, new.pid,
                       self.num_restarts)
        if self.on_restart is not None:
            self.on_restart()
        self.on_ready(new)

    @staticmethod
    async def _retire(old: EngineCoreClient) -> None:
        """Stops watching ``old`` (on the loop) and closes it (in a thread: it may wait for a process)."""
        old.detach()
        await asyncio.to_thread(old.close, 1.0)

    async def _adopt(self, new: EngineCoreClient) -> bool:
        """Makes ``new`` the serving client and watches it. Returns False (after closing ``new``) when
        the supervisor is closing."""
        if self._closing:
            await asyncio.to_thread(new.close)
            return False
        self.client = new
        self.watch()
        self.unavailable = None
        return True

    async def close(self) -> None:
        """Stops restarting and closes the current core (waits for it to exit, then kills it)."""
        self._closing = True
        if self._task is not None and not self._task.done():
            await asyncio.gather(self._task, return_exceptions=True)
        self.client.detach()
        await asyncio.to_thread(self.client.close)
