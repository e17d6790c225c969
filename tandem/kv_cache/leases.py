"""Leases on held KV blocks: a finished request's blocks pinned for a transfer until released or expired.

A lease owns one reference to each of its blocks (so the pool never reuses them) and an expiry time
on a monotonic clock (seconds). ``KVCacheManager`` creates, renews, releases and expires leases;
this module only keeps the table. No tensors.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tandem.kv_cache.block_pool import KVCacheBlock

DEFAULT_LEASE_TTL_S = 30.0  # seconds a held block stays pinned unless renewed


class UnknownLeaseError(KeyError):
    """No lease with this id (never created, released, or already expired)."""


@dataclass(eq=False)
class Lease:
    """Blocks pinned under ``lease_id`` until ``expires_at`` (seconds on the manager's clock)."""

    lease_id: str
    blocks: list[KVCacheBlock]
    expires_at: float

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


class LeaseTable:
    """Leases by id, with a clock.

    Args:
        ttl_s: default lease duration (seconds, > 0).
        clock: a monotonic clock in seconds (``time.monotonic``; tests inject a fake one).

    Raises:
        ValueError: ``ttl_s <= 0``.
    """

    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        if not ttl_s > 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {ttl_s}")
        self.ttl_s = ttl_s
        self.clock = clock
        self._leases: dict[str, Lease] = {}
        # NOTE: a min-heap of (expiry, id); renewals push a new entry and stale ones are skipped when popped,
        # so finding the expired leases costs O(expired log n), not a scan of every lease.
        self._expiries: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self) -> Iterator[Lease]:
        return iter(list(self._leases.values()))

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._leases

    def add(self, lease_id: str, blocks: list[KVCacheBlock], ttl_s: float | None = None) -> Lease:
        """Records a new lease expiring ``ttl_s`` (default ``self.ttl_s``) seconds from now.

        Raises:
            ValueError: the id is already leased, or ``ttl_s <= 0``.
        """
        if lease_id in self._leases:
            raise ValueError(f"lease {lease_id!r} already exists")
        lease = Lease(lease_id, blocks, self._expiry(ttl_s))
        self._leases[lease_id] = lease
        heapq.heappush(self._expiries, (lease.expires_at, lease_id))
        return lease

    def get(self, lease_id: str) -> Lease:
        """The lease (changes nothing). Raises ``UnknownLeaseError``."""
        try:
            return self._leases[lease_id]
        except KeyError:
            raise UnknownLeaseError(lease_id) from None

    def renew(self, lease_id: str, ttl_s: float | None = None) -> float:
        """Moves the expiry to ``ttl_s`` seconds from now; returns it. Raises ``UnknownLeaseError``."""
        lease = self.get(lease_id)
        lease.expires_at = self._expiry(ttl_s)
        heapq.heappush(self._expiries, (lease.expires_at, lease_id))
        return lease.expires_at

    def pop(self, lease_id: str) -> Lease:
        """Removes and returns the lease. Raises ``UnknownLeaseError``."""
        lease = self.get(lease_id)
        del self._leases[lease_id]
        return lease

    def expired_ids(self) -> list[str]:
        """Ids of the leases whose expiry is at or before now, soonest first.

        Changes: drops their entries (and stale ones of renewed or released leases) from the expiry heap;
        the leases themselves stay until ``pop``.
        """
        now, expired = self.clock(), []
        while self._expiries and self._expiries[0][0] <= now:
            expires_at, lease_id = heapq.heappop(self._expiries)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.expires_at == expires_at and lease_id not in expired:
                expired.append(lease_id)
        return expired

    def _expiry(self, ttl_s: float | None) -> float:
        ttl = self.ttl_s if ttl_s is None else ttl_s
        if not ttl > 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {ttl}")
        return self.clock() + ttl
