"""Which KV blocks each backend holds, as the router sees it: exact (KV events) or approximate.

Both index kinds answer one question for the kv-aware policy (``policy.py``): given a prompt's
chained block hashes (``kv_cache.hashing.hash_token_blocks(token_ids, block_size)``, 256-bit ints),
how many *leading* blocks does this backend hold? Because hash ``i`` names the whole prefix of
blocks ``0..i``, an engine's prefix cache can only serve a run from block 0, so ``match`` counts
until the first miss.

The interface (``BlockIndex``), used by ``policy.KVAwarePolicy`` and by ``serve -dp N``:

- ``match(block_hashes) -> int``: leading blocks held. No state changes.
- ``on_dispatch(block_hashes)`` / ``on_complete(block_hashes)``: the router sent a request with this
  prompt here / it finished. Called by ``Policy.on_dispatch`` / ``on_complete``.
- ``clear()``: forget everything (e.g. the backend was restarted).

Kinds:

- ``EventBlockIndex``: the exact set of hashes an engine announced in its KV event batches
  (``kv_cache/events.py``; ``apply(seq, batch)`` per received message). A gap in ``seq`` means
  lost events (a lower ``seq``: the engine restarted): the set is cleared and rebuilt from later
  events, or at once from the publisher's snapshot (``load_snapshot``) when it has a replay socket.
  Between dispatch and the engine's ``BlockStored`` (sent after the prefill step) the prompt's
  hashes count as *pending*, so a burst of requests with one prefix lands on the same engine;
  pending hashes end ``pending_grace_s`` seconds after the request completes (by then the events
  have told the truth), or on removal.
- ``ApproxBlockIndex``: for backends that publish no events (vLLM without events, llama.cpp, a
  Tandem started without ``--kv-events-config``): the hashes of the prompts the router sent there,
  an LRU of at most ``capacity_blocks`` entries standing for the backend's cache. Recording a prompt
  touches its blocks leaf first, so the LRU evicts leaves before their parents, as a prefix tree
  would. ``observe_hit(predicted, cached)`` corrects the capacity from a response's
  ``usage.prompt_tokens_details.cached_tokens`` (vLLM, llama.cpp report it): a smaller hit than
  predicted means the backend's cache is smaller than assumed, so the LRU shrinks.

Not thread-safe: the router calls every method from its one asyncio loop.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from tandem.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, hash_from_bytes

logger = logging.getLogger(__name__)

DEFAULT_APPROX_CAPACITY_BLOCKS = 8192  # ~131k tokens at block size 16
DEFAULT_PENDING_GRACE_S = 2.0


class BlockIndex(Protocol):
    """What the kv-aware policy needs of a backend's index (see the module docstring)."""

    def match(self, block_hashes: Sequence[int]) -> int: ...

    def on_dispatch(self, block_hashes: Sequence[int]) -> None: ...

    def on_complete(self, block_hashes: Sequence[int]) -> None: ...

    def clear(self) -> None: ...


def _leading(block_hashes: Sequence[int], held: Callable[[int], bool]) -> int:
    n = 0
    for h in block_hashes:
        if not held(h):
            break
        n += 1
    return n


class EventBlockIndex:
    """The exact block set of one engine, fed by its KV event batches (+ pending dispatches).

    Args:
        pending_grace_s: seconds a completed request's prompt hashes still count as held while the
            engine's ``BlockStored`` may be in flight.
        clock: monotonic seconds (injectable for tests).

    Attributes:
        blocks: hashes the engine announced and has not removed.
        next_seq: the sequence number expected next (None before the first message).
        gaps: how many times lost events cleared the index.
    """

    def __init__(self, pending_grace_s: float = DEFAULT_PENDING_GRACE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.blocks: set[int] = set()
        self.next_seq: int | None = None
        self.gaps = 0
        self._grace_s = pending_grace_s
        self._clock = clock
        self._inflight: dict[int, int] = {}  # hash -> requests in flight with it
        self._recent: dict[int, float] = {}  # hash -> expiry (completed, grace running)
        self._skip_below: int | None = None  # after a snapshot: earlier batches are in it already

    def apply(self, seq: int, batch: KVEventBatch) -> bool:
        """Applies one received batch; returns False when ``seq`` showed a gap (the index was cleared first).

        Changes: ``blocks``, ``next_seq``, ``gaps``; removed hashes leave the pending sets too. A batch
        older than a loaded snapshot (queued before it was taken) is skipped.
        """
        if self._skip_below is not None:
            if seq < self._skip_below:
                return True
            self._skip_below = None
        ok = self.next_seq is None or seq == self.next_seq
        if not ok:
            logger.warning("KV events: expected seq %d, got %d; index of %r cleared", self.next_seq, seq,
                           batch.engine_id)
            self.gaps += 1
            self.blocks.clear()
        self.next_seq = seq + 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.blocks.update(hash_from_bytes(h) for h in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                for raw in event.block_hashes:
                    h = hash_from_bytes(raw)
                    self.blocks.discard(h)
                    self._inflight.pop(h, None)
                    self._recent.pop(h, None)
            elif isinstance(event, AllBlocksCleared):
                self.clear()
        return ok

    def load_snapshot(self, seq: int, batch: KVEventBatch) -> None:
        """Replaces the announced set by a publisher's snapshot, valid before its batch ``seq``
        (``kv_cache.events.fetch_snapshot``); batches below ``seq`` are then skipped.

        Changes: ``blocks``, ``next_seq`` (pending dispatches are kept: they are the router's own).
        """
        self.blocks.clear()
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.blocks.update(hash_from_bytes(h) for h in event.block_hashes)
        self.next_seq = seq
        self._skip_below = seq

    def _held(self, h: int) -> bool:
        if h in self.blocks or h in self._inflight:
            return True
        expiry = self._recent.get(h)
        return expiry is not None and expiry > self._clock()

    def match(self, block_hashes: Sequence[int]) -> int:
        """Leading blocks of ``block_hashes`` announced or pending here. No state changes."""
        return _leading(block_hashes, self._held)

    def on_dispatch(self, block_hashes: Sequence[int]) -> None:
        """Counts the prompt's hashes as pending. Changes: the in-flight counts."""
        for h in block_hashes:
            self._inflight[h] = self._inflight.get(h, 0) + 1

    def on_complete(self, block_hashes: Sequence[int]) -> None:
        """Ends one dispatch's pending hold; the grace period starts. Changes: the pending sets."""
        now = self._clock()
        expiry = now + self._grace_s
        for h in block_hashes:
            n = self._inflight.get(h, 0) - 1
            if n > 0:
                self._inflight[h] = n
            elif n == 0:
                del self._inflight[h]
                self._recent[h] = expiry
        if len(self._recent) > 4 * DEFAULT_APPROX_CAPACITY_BLOCKS:
            self._recent = {h: t for h, t in self._recent.items() if t > now}

    def clear(self) -> None:
        """Forgets every announced and pending hash (``next_seq`` is kept). Changes: all sets."""
        self.blocks.clear()
        self._inflight.clear()
        self._recent.clear()


class EnginesBlockIndex:
    """The exact block sets of the several engines behind one backend (``tandem serve -dp N`` publishing
    each engine's KV events: ``/load`` lists them under ``engines``), one ``EventBlockIndex`` each.

    A prompt's match is its longest one on any engine, since the backend's own kv-aware router sends it to
    the engine that holds the most of it. The router's own dispatches are pending in ``pending`` (an
    ``EventBlockIndex`` no events feed): which engine the backend picks is not known here.

    Args:
        engines: one index per engine, in rank order (each fed by its own subscriber).
        pending_grace_s / clock: as for ``EventBlockIndex`` (for ``pending``).
    """

    def __init__(self, engines: Sequence[EventBlockIndex], pending_grace_s: float = DEFAULT_PENDING_GRACE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engines = list(engines)
        self.pending = EventBlockIndex(pending_grace_s, clock)

    @property
    def blocks(self) -> set[int]:
        """Every hash some engine announced (a new set). No state changes."""
        return set().union(*(e.blocks for e in self.engines))

    @property
    def gaps(self) -> int:
        return sum(e.gaps for e in self.engines)

    def match(self, block_hashes: Sequence[int]) -> int:
        """The most leading blocks of ``block_hashes`` held by one engine, or pending. No state changes."""
        return max([self.pending.match(block_hashes), *(e.match(block_hashes) for e in self.engines)])

    def on_dispatch(self, block_hashes: Sequence[int]) -> None:
        """Counts the prompt's hashes as pending. Changes: ``pending``."""
        self.pending.on_dispatch(block_hashes)

    def on_complete(self, block_hashes: Sequence[int]) -> None:
        """Ends one dispatch's pending hold (the grace period starts). Changes: ``pending``."""
        self.pending.on_complete(block_hashes)

    def clear(self) -> None:
        """Forgets every engine's and every pending hash. Changes: all indexes."""
        self.pending.clear()
        for e in self.engines:
            e.clear()


class ApproxBlockIndex:
    """An LRU of the prompt blocks the router sent to one backend that publishes no events.

    Args:
        capacity_blocks: how many blocks the backend's prefix cache is assumed to hold (its KV
            capacity when known, e.g. from Tandem's ``/load``); the least recently sent go first.

    Raises:
        ValueError: ``capacity_blocks < 1``.
    """

    def __init__(self, capacity_blocks: int = DEFAULT_APPROX_CAPACITY_BLOCKS) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, block_hashes: Sequence[int]) -> int:
        """Leading blocks of ``block_hashes`` believed cached. No state changes."""
        return _leading(block_hashes, self._lru.__contains__)

    def on_dispatch(self, block_hashes: Sequence[int]) -> None:
        """Records the prompt as cached, leaf first (so parents outlive children); evicts past capacity.

        Changes: the LRU.
        """
        for h in reversed(block_hashes):
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.capacity_blocks:
            self._lru.popitem(last=False)

    def on_complete(self, block_hashes: Sequence[int]) -> None:
        """Nothing to do: the blocks were recorded on dispatch."""

    def forget(self, block_hashes: Sequence[int]) -> None:
        """Drops blocks recorded on dispatch that the backend never computed (the request failed or was
        refused: a 4xx / 5xx / 429 or no answer); otherwise a later hit on them would be predicted, not
        found, and ``observe_hit`` would shrink the capacity for good. Changes: the LRU."""
        for h in block_hashes:
            self._lru.pop(h, None)

    def observe_hit(self, predicted_blocks: int, cached_blocks: int) -> None:
        """Corrects the capacity from a response's reported prefix hit (``usage.prompt_tokens_details
        .cached_tokens // block_size``) against what ``match`` predicted before dispatch.

        A smaller hit than predicted means the backend evicted blocks this LRU still held, i.e. its
        cache is smaller than assumed: the capacity shrinks by the difference (never below 1) and
        the oldest entries go. (The prompt's own blocks were just recomputed and recorded, so they
        stay.) Changes: ``capacity_blocks``, the LRU.
        """
        missing = predicted_blocks - cached_blocks
        if missing <= 0:
            return
        self.capacity_blocks = max(1, min(self.capacity_blocks, len(self._lru)) - missing)
        while len(self._lru) > self.capacity_blocks:
            self._lru.popitem(last=False)

    def clear(self) -> None:
        """Forgets every block. Changes: the LRU."""
        self._lru.clear()
