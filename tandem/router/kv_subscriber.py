"""Subscribes to one engine's KV events (ZeroMQ SUB, ``kv_cache/events.py``) and feeds its index.

Where a Tandem backend publishes is given by ``--kv-events URL=ENDPOINT`` or read from its
``GET /load`` (``kv_events``: ``{"endpoint", "topic", ...}``, None when it publishes none). An
endpoint bound to every interface (``tcp://*:5557``, ``tcp://0.0.0.0:5557``) is reached at the
backend URL's host.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import urlsplit

import msgspec

from tandem.kv_cache.events import fetch_snapshot, parse_message
from tandem.router.kv_index import EventBlockIndex

logger = logging.getLogger(__name__)

_ANY_HOSTS = ("*", "0.0.0.0", "[::]", "::")


def reachable_endpoint(endpoint: str, backend_url: str) -> str:
    """``endpoint`` with a wildcard host replaced by the backend's host (``tcp://`` only)."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if sep and host in _ANY_HOSTS:
        return f"tcp://{urlsplit(backend_url).hostname}:{port}"
    return endpoint


def endpoint_from_load(load: dict[str, Any], backend_url: str) -> tuple[str, str, str | None] | None:
    """(endpoint, topic, replay endpoint or None) from a Tandem ``/load`` answer, or None when the
    backend publishes no events."""
    info = load.get("kv_events")
    if isinstance(info, dict) and isinstance(info.get("endpoint"), str) and info["endpoint"]:
        replay = info.get("replay_endpoint")
        replay = reachable_endpoint(replay, backend_url) if isinstance(replay, str) and replay else None
        return reachable_endpoint(info["endpoint"], backend_url), str(info.get("topic") or ""), replay
    return None


def endpoints_from_load(load: dict[str, Any], backend_url: str) -> list[tuple[str, str, str | None]] | None:
    """Every KV event feed of a Tandem ``/load`` answer: the server's own (``kv_events``: one engine), else one
    per engine when each of its ``engines`` publishes (``tandem serve -dp N --kv-events-config ...``); None
    when there is no such feed (or an engine publishes none: its blocks would be unknown)."""
    found = endpoint_from_load(load, backend_url)
    if found is not None:
        return [found]
    engines = load.get("engines")
    if not isinstance(engines, list) or not engines:
        return None
    feeds = [endpoint_from_load(e, backend_url) if isinstance(e, dict) else None for e in engines]
    return None if None in feeds else feeds  # type: ignore[return-value]


def engine_keys(load: dict[str, Any], backend_url: str) -> list[tuple[str, object]] | None:
    """Per KV event feed of ``endpoints_from_load``: (endpoint, restarts of its engine core), which changes
    when that engine was restarted (its cache is empty, its endpoint may be new); None as there. No state
    changes."""
    feeds = endpoints_from_load(load, backend_url)
    if feeds is None:
        return None
    engines = load.get("engines") if load.get("kv_events") is None else None
    restarts = ([e.get("restarts") for e in engines] if isinstance(engines, list)
                else [load.get("restarts")])
    return [(feed[0], n) for feed, n in zip(feeds, restarts, strict=True)]


class KVEventSubscriber:
    """One SUB socket feeding ``index`` until ``close``.

    With a ``replay_endpoint`` the index starts from the publisher's snapshot (taken after
    subscribing, so no batch falls between) and a gap in ``seq`` reloads one instead of waiting for
    new events to rebuild the index.

    Args:
        endpoint: the publisher's ZeroMQ address. topic: the subscription prefix ("" = all).
        index: the backend's ``EventBlockIndex`` (``apply`` per message).
        name: the backend (for logs). replay_endpoint: its snapshot socket, or None.

    Attributes:
        received / malformed / snapshots: messages applied / dropped as unreadable; snapshots loaded.
    """

    def __init__(self, endpoint: str, topic: str, index: EventBlockIndex, name: str,
                 replay_endpoint: str | None = None) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.snapshots = 0
        self.topic = topic
        self.index = index
        self.name = name
        self.received = 0
        self.malformed = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Connects and starts the receive task on the running loop. Changes: the task."""
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 100_000)
        self._sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        self._sock.connect(self.endpoint)
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events {self.name}")
        logger.info("backend %s: KV events from %s", self.name, self.endpoint)

    async def _run(self) -> None:
        await self._snapshot()
        while True:
            frames = await self._sock.recv_multipart()
            try:
                seq, batch = parse_message(frames)
            except (ValueError, msgspec.DecodeError) as e:
                self.malformed += 1
                logger.warning("backend %s: unreadable KV event message dropped: %s", self.name, e)
                continue
            self.received += 1
            if not self.index.apply(seq, batch):
                await self._snapshot()

    async def _snapshot(self) -> None:
        """Loads the publisher's snapshot when it has a replay socket; a failure is logged (the index
        then rebuilds from new events). Changes: the index, ``snapshots``."""
        if self.replay_endpoint is None:
            return
        try:
            seq, batch = await asyncio.to_thread(fetch_snapshot, self.replay_endpoint, 5.0)
        except (TimeoutError, ValueError, msgspec.DecodeError) as e:
            logger.warning("backend %s: no KV snapshot from %s: %s", self.name, self.replay_endpoint, e)
            return
        self.index.load_snapshot(seq, batch)
        self.snapshots += 1

    async def close(self) -> None:
        """Stops the task and closes the socket. Changes: the task, the socket."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
            self._sock.close(linger=0)
            self._ctx.term()

    def describe(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint, "received": self.received,
                "malformed": self.malformed, "snapshots": self.snapshots,
                "gaps": self.index.gaps, "blocks": len(self.index.blocks)}
