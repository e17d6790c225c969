"""Admission policies: the order of the waiting queue, FCFS or priority (vLLM semantics).

The scheduler walks the queue in policy order and admits ready requests until one does not fit;
a request that is not ready (``Request.is_ready()``: KV still on the wire, grammar compiling) is
skipped and keeps its place, so it never blocks the requests behind it. No tensors.

- ``FCFSQueue``: arrival order; a preempted request goes back to the front.
- ``PriorityQueue``: ``(priority, arrival_time)`` ascending, lower ``priority`` first (vLLM's
  ``SchedulingPolicy.PRIORITY``); a preempted request returns at its own place in that order.
- "lpm" keeps an ``FCFSQueue`` that the scheduler reorders each step by prefix-cache hit (``lpm.py``).
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Protocol

from tandem.request import Request


class WaitingQueue(Protocol):
    """The scheduler's waiting requests, iterated in admission order."""

    def add(self, request: Request) -> None:
        """Queues a new (or newly ready) request. Changes: the queue."""

    def add_preempted(self, request: Request) -> None:
        """Queues a request just preempted (it keeps precedence over newer arrivals). Changes: the queue."""

    def remove(self, request: Request) -> None:
        """Drops one request (it must be queued). Changes: the queue. Raises ValueError if absent."""

    def remove_ids(self, request_ids: set[str]) -> None:
        """Drops every queued request whose id is in ``request_ids``. Changes: the queue."""

    def __iter__(self) -> Iterator[Request]: ...

    def __len__(self) -> int: ...


class FCFSQueue:
    """First come, first served (preempted requests go to the front)."""

    def __init__(self, requests: Iterable[Request] = ()) -> None:
        self._queue: deque[Request] = deque(requests)

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def remove_ids(self, request_ids: set[str]) -> None:
        self._queue = deque(r for r in self._queue if r.request_id not in request_ids)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._queue))

    def __len__(self) -> int:
        return len(self._queue)


class PriorityQueue:
    """Lowest ``priority`` first, then earliest ``arrival_time``, then insertion order (stable)."""

    def __init__(self) -> None:
        self._counter = itertools.count()
        self._entries: list[tuple[int, float, int, Request]] = []  # sorted

    def add(self, request: Request) -> None:
        bisect.insort(self._entries, (request.priority, request.arrival_time, next(self._counter), request),
                      key=lambda e: e[:3])

    def add_preempted(self, request: Request) -> None:
        self.add(request)  # NOTE: its arrival time keeps it ahead of newer arrivals of equal priority

    def remove(self, request: Request) -> None:
        for i, entry in enumerate(self._entries):
            if entry[3] is request:
                del self._entries[i]
                return
        raise ValueError(f"request {request.request_id} is not queued")

    def remove_ids(self, request_ids: set[str]) -> None:
        self._entries = [e for e in self._entries if e[3].request_id not in request_ids]

    def __iter__(self) -> Iterator[Request]:
        return iter([e[3] for e in self._entries])

    def __len__(self) -> int:
        return len(self._entries)


def make_waiting_queue(policy: str) -> WaitingQueue:
    """The queue of ``SchedulerConfig.policy``: "fcfs" and "lpm" (which reorders an FCFS queue each step,
    ``lpm.py``) or "priority". Raises ValueError otherwise."""
    if policy in ("fcfs", "lpm"):
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}; choose 'fcfs', 'priority' or 'lpm'")
