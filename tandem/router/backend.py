"""One OpenAI-compatible HTTP backend of the router: routing state, health, KV event feed, discovery."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx

from tandem.router.config import RouterConfig
from tandem.router.health import BackendHealth
from tandem.router.kv_index import (
    DEFAULT_APPROX_CAPACITY_BLOCKS,
    ApproxBlockIndex,
    EnginesBlockIndex,
    EventBlockIndex,
)
from tandem.router.kv_subscriber import KVEventSubscriber, endpoints_from_load, engine_keys

logger = logging.getLogger(__name__)

PROBE_READ_TIMEOUT_S = 5.0  # for /health and /load answers


class FirstByteWait:
    """One request waiting for a backend's first response byte, under ``asyncio.timeout``; an ejection
    of the backend ends the wait at once (``ejected`` True), as the timeout would."""

    def __init__(self, timeout: asyncio.Timeout) -> None:
        self.timeout = timeout
        self.ejected = False

    def cut(self) -> None:
        """Ends the wait now (the waiting task gets ``TimeoutError``) unless its time is already up.
        Changes: ``ejected``, the deadline."""
        if not self.timeout.expired():
            self.ejected = True
            self.timeout.reschedule(asyncio.get_running_loop().time())


class HttpBackend:
    """An HTTP backend (Tandem, vLLM, llama.cpp's server, ...) behind the router.

    Attributes:
        url: its base URL. state: its ``BackendState`` (the policy's view). health: ``BackendHealth``.
        subscribers: its KV event feeds when it publishes events: one (then ``state.index`` is an
            ``EventBlockIndex``), or one per engine of a ``tandem serve -dp N`` (an ``EnginesBlockIndex``);
            none: an ``ApproxBlockIndex``. ``subscriber``: the first, or None.
        load: its last ``/load`` answer (Tandem only; None for other servers or before discovery).
        busy_until: monotonic time until which it is skipped after answering 429 (its ``Retry-After``).
        waiting: the requests sent to it that wait for their first response byte (``FirstByteWait``);
            a silent ejection (``health.py``: it stopped answering) cuts them short, so they are retried
            elsewhere instead of waiting on a hung server; after a refusal (a draining server) they wait on.
    """

    def __init__(self, url: str, config: RouterConfig, on_eject: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        from tandem.router.policy import BackendState

        self.url = url
        self.config = config
        self._clock = clock
        capacity = config.approx_capacity_blocks or DEFAULT_APPROX_CAPACITY_BLOCKS
        self.state = BackendState(url, max_outstanding=config.max_outstanding_per_backend,
                                  index=ApproxBlockIndex(capacity))
        self._on_eject = on_eject
        self.health = BackendHealth(self.state, config.failure_threshold, config.eject_s, config.max_eject_s,
                                    clock, self._ejected)
        self.waiting: set[FirstByteWait] = set()
        self.subscribers: list[KVEventSubscriber] = []
        self.feed_keys: list[tuple[str, object]] = []  # engine_keys of the subscribed /load
        self._stopped: set[int] = set()  # engines /load last reported not healthy
        self.load: dict[str, Any] | None = None
        self.answered_load = False  # it answered GET /load at least once (any status)
        self.busy_until = 0.0
        # NOTE: a busy server may take seconds to answer; only failing to connect is quick evidence
        self._probe_timeout = httpx.Timeout(PROBE_READ_TIMEOUT_S, connect=config.connect_timeout_s)

    def _ejected(self, reason: str) -> None:
        self._on_eject(reason)
        if self.health.last_silent:
            for wait in list(self.waiting):
                wait.cut()

    @property
    def busy(self) -> bool:
        return self._clock() < self.busy_until

    def mark_busy(self, retry_after: str | None) -> None:
        """Skips the backend for its ``Retry-After`` seconds (default: the router's). Changes: ``busy_until``."""
        try:
            seconds = float(retry_after) if retry_after is not None else self.config.retry_after_s
        except ValueError:
            seconds = self.config.retry_after_s
        self.busy_until = self._clock() + max(0.0, min(seconds, 60.0))

    async def fetch_load(self, client: httpx.AsyncClient) -> dict[str, Any] | None:
        """Its ``GET /load`` JSON (None when it is not a Tandem server or does not answer). Changes: ``load``,
        ``answered_load``."""
        try:
            r = await client.get(f"{self.url}/load", timeout=self._probe_timeout)
            self.answered_load = True
            data = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            data = None
        self.load = data if isinstance(data, dict) else None
        return self.load

    @property
    def subscriber(self) -> KVEventSubscriber | None:
        return self.subscribers[0] if self.subscribers else None

    def use_events(self, endpoint: str, topic: str = "", replay_endpoint: str | None = None) -> None:
        """Switches to an exact index fed from ``endpoint`` (the caller starts ``subscribers``). Changes:
        ``state.index``, ``subscribers``."""
        self.use_engine_events([(endpoint, topic, replay_endpoint)])

    def use_engine_events(self, feeds: list[tuple[str, str, str | None]]) -> None:
        """Switches to an exact index fed by ``feeds`` (endpoint, topic, replay endpoint): one engine's, or
        each engine's of a data-parallel server (``EnginesBlockIndex``); the caller starts ``subscribers``.
        Changes: ``state.index``, ``subscribers``."""
        indexes = [EventBlockIndex() for _ in feeds]
        self.state.index = indexes[0] if len(indexes) == 1 else EnginesBlockIndex(indexes)
        self.subscribers = [KVEventSubscriber(endpoint, topic, index, self._feed_name(rank, len(feeds)), replay)
                            for rank, ((endpoint, topic, replay), index) in enumerate(zip(feeds, indexes, strict=True))]
        self.feed_keys = [(feed[0], None) for feed in feeds]

    def _feed_name(self, rank: int, n: int) -> str:
        return self.url if n == 1 else f"{self.url} engine {rank}"

    def restarted_feeds(self) -> list[int] | None:
        """The feeds (ranks) whose engine ``load`` shows restarted or publishing elsewhere since they were
        subscribed; None when the feeds no longer line up (their number changed, one stopped publishing,
        or the events come from ``--kv-events``): the caller configures the backend anew. No state changes."""
        if dict(self.config.kv_events).get(self.url) is not None or not self.subscribers:
            return []
        keys = engine_keys(self.load or {}, self.url)
        if keys is None or len(keys) != len(self.subscribers):
            return None
        return [rank for rank, (old, new) in enumerate(zip(self.feed_keys, keys, strict=True))
                if old[0] != new[0] or old[1] is not None and old[1] != new[1]]

    def note_feed_keys(self) -> None:
        """Records ``load``'s engine keys as the subscribed ones (after a subscription, or a first look).
        Changes: ``feed_keys``."""
        keys = engine_keys(self.load or {}, self.url)
        if keys is not None and len(keys) == len(self.subscribers):
            self.feed_keys = keys

    def forget_stopped_engines(self) -> list[int]:
        """Empties the index of each engine ``load`` reports not healthy (a dead core, one not restarted after
        a crash loop, or one being restarted): its blocks are not served. Returns those ranks. Changes: their
        indexes (for a data-parallel backend also the router's pending holds, which cannot be told apart)."""
        index = self.state.index
        load = self.load or {}
        engines = load.get("engines") if isinstance(index, EnginesBlockIndex) else [load]
        if not isinstance(engines, list):
            return []
        stopped = [rank for rank, e in enumerate(engines) if isinstance(e, dict) and e.get("healthy") is False]
        for rank in stopped:
            if isinstance(index, EnginesBlockIndex):
                if rank < len(index.engines):
                    index.engines[rank].clear()
                if rank not in self._stopped:
                    index.pending.clear()
            elif isinstance(index, EventBlockIndex):
                index.clear()
        self._stopped = set(stopped)
        return stopped

    def renew_feed(self, rank: int) -> KVEventSubscriber:
        """Gives feed ``rank`` (an engine restarted: its cache is empty) an empty index and a new subscriber
        at its current endpoint (the caller closes the old one and starts the new). Changes: the index,
        ``subscribers[rank]``, ``feed_keys[rank]``."""
        feeds = endpoints_from_load(self.load or {}, self.url)
        endpoint, topic, replay = feeds[rank]  # type: ignore[index]
        index = EventBlockIndex()
        if isinstance(self.state.index, EnginesBlockIndex):
            self.state.index.engines[rank] = index
            self.state.index.pending.clear()  # NOTE: the router's own holds may be that engine's: not known which
        else:
            self.state.index = index
        self.subscribers[rank] = KVEventSubscriber(endpoint, topic, index, self._feed_name(rank, len(feeds)), replay)
        self.feed_keys[rank] = engine_keys(self.load or {}, self.url)[rank]  # type: ignore[index]
        return self.subscribers[rank]

    def configure(self, block_size: int) -> None:
        """Chooses the index from the discovery: events (``--kv-events`` or ``/load``'s ``kv_events``) when
        the backend's block size equals the router's, else the approximate index sized from
        ``/load``'s ``num_kv_blocks``. A data-parallel Tandem server whose every engine publishes gets one
        subscription per engine. Changes: ``state.index``, ``subscribers`` (not started)."""
        load = self.load or {}
        self.subscribers = []
        explicit = dict(self.config.kv_events).get(self.url)
        if load.get("block_size") not in (None, block_size):
            logger.warning("backend %s has block size %s, the router %d: routing on approximate prefixes",
                           self.url, load.get("block_size"), block_size)
        elif explicit is not None:
            self.use_events(explicit)
            return
        else:
            found = endpoints_from_load(load, self.url)
            if found is not None:
                self.use_engine_events(found)
                self.note_feed_keys()
                return
        blocks = load.get("num_kv_blocks")
        if self.config.approx_capacity_blocks is None and isinstance(blocks, int) and blocks > 0:
            self.state.index = ApproxBlockIndex(blocks)

    def events_moved(self) -> bool:
        """True when ``load`` names another KV event endpoint than the one subscribed (a restarted
        engine bound a new port, or one discovered late), or none while one is subscribed (it
        publishes no more). No state changes."""
        if dict(self.config.kv_events).get(self.url) is not None:
            return False
        found = endpoints_from_load(self.load or {}, self.url) or []
        return [feed[0] for feed in found] != [sub.endpoint for sub in self.subscribers]

    async def probe(self, client: httpx.AsyncClient) -> tuple[bool, str, bool]:
        """One active ``GET /health``: (ok, reason, silent: it timed out). No state changes (the caller
        reports to ``health``)."""
        try:
            r = await client.get(f"{self.url}/health", timeout=self._probe_timeout)
        except httpx.HTTPError as e:
            return False, f"health check: {type(e).__name__}: {e}", isinstance(e, httpx.TimeoutException)
        return r.status_code == 200, f"health check answered {r.status_code}", False

    def describe(self, hit_rate: float | None) -> dict[str, Any]:
        """The JSON-ready view for ``GET /backends``. No state changes."""
        s = self.state
        index = s.index
        return {"url": self.url, "healthy": s.healthy, **self.health.describe(),
                "outstanding_requests": s.outstanding_requests, "outstanding_tokens": s.outstanding_tokens,
                "max_outstanding": s.max_outstanding, "busy_for_s": round(max(0.0, self.busy_until - self._clock()), 3),
                "index": "kv-events" if self.subscribers else "approximate",
                "indexed_blocks": (len(index.blocks) if isinstance(index, EventBlockIndex | EnginesBlockIndex)
                                   else len(index)),
                "kv_events": (None if not self.subscribers else self.subscribers[0].describe()
                              if len(self.subscribers) == 1 else [sub.describe() for sub in self.subscribers]),
                "routed_prefix_hit_rate": hit_rate}
