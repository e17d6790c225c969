"""The pool of KV blocks: reference counts, an LRU free queue and the prefix-cache map ``hash -> block``.

Follows vLLM v1's ``BlockPool`` (automatic prefix caching over PagedAttention blocks):

- A block is *owned* while ``ref_cnt > 0`` (several requests may share a cached prefix block).
- A block with ``ref_cnt == 0`` is in the free queue, ordered least recently freed first: freed blocks
  go to the tail, allocation takes from the head. A freed block keeps its hash and stays findable in
  the prefix cache until allocation evicts it (which removes its hash).
- Touching a cached free block (a prefix hit) takes it out of the free queue in O(1).

The life of a block: **allocated** (``get_new_blocks``: ref 1, no hash, content garbage) ->
**written** (its KV computed or received; only then ``cache_full_blocks`` gives a full block its
hash) -> optionally **held** (its request finished, a lease keeps the reference; see
``KVCacheManager.hold``) -> **freed** (ref 0, in the free queue, still hashable until evicted). The
pool does not know who owns a reference (a request's table or a lease); ``KVCacheManager`` does and
its ``check`` accounts for both.

There is no reserved null block: ids ``0 .. num_blocks - 1`` are all usable. A runner that pads a
block table must mask the padded entries (they may point at live blocks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.kv_cache.events import EventRecorder


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    """One block of ``block_size`` token slots; ``block_hash`` is set while it is in the prefix cache.

    ``generation`` counts the block's allocations (``BlockPool.get_new_blocks``): a reader that noted
    (id, generation) can tell that the block was freed and reused since (a KV transfer refuses it).
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    generation: int = 0


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(f"KV cache integrity: {message}")


class BlockPool:
    """All KV blocks of one engine.

    Args:
        num_blocks: blocks in the pool (>= 1).
        enable_caching: keep the ``hash -> block`` map (automatic prefix caching).
        events: when given, every change of the ``hash -> block`` map is reported to it (stored,
            removed on eviction, cleared), for KV-aware routers (``kv_cache/events.py``).

    Raises:
        ValueError: ``num_blocks < 1``.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 events: EventRecorder | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # NOTE: an OrderedDict is a doubly linked list with O(1) removal by key, which a touch needs.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVCacheBlock] = {}
        self.events = events

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ``ref_cnt == 0`` (including cached ones that can still be evicted)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Entries of the prefix-cache map (owned or free)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by some request (0..1)."""
        return 1.0 - len(self._free) / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """Ids in the free queue, next to be allocated first (a copy; for tests and debugging)."""
        return list(self._free)

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        """The block holding the prefix with this hash, or None. Changes nothing."""
        return self._cached.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Takes ``num_blocks`` blocks from the head of the free queue, each with ``ref_cnt = 1``.

        Changes: the free queue; evicts the prefix-cache entry of every cached block it takes; bumps
        each taken block's ``generation``.

        Raises:
            ValueError: fewer than ``num_blocks`` free blocks (check ``num_free_blocks`` first).
        """
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {len(self._free)} free")
        taken = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            block.generation += 1
            taken.append(block)
        return taken

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                if self.events is not None:
                    self.events.removed((block.block_hash,))
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Adds one reference to each block (a prefix hit).

        Changes: ``ref_cnt``; a block at ``ref_cnt == 0`` leaves the free queue (it keeps its hash).
        """
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference from each block; blocks reaching 0 join the free queue's tail in this order.

        So the first block given is evicted first among them. Changes: ``ref_cnt``, the free queue.
        """
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[int]) -> int:
        """Registers ``blocks[i]`` under ``block_hashes[i]`` in the prefix cache; returns how many were added.

        A block already holding that hash is skipped. When another block already holds the hash (two
        requests computed the same prefix at once) the first one stays and this block stays uncached.
        Changes: the ``hash -> block`` map and ``block_hash`` fields. No-op when caching is disabled.
        """
        if not self.enable_caching:
            return 0
        added = 0
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is not None:
                assert block.block_hash == block_hash, f"block {block.block_id} re-cached under a new hash"
                continue
            if block_hash in self._cached:
                continue
            block.block_hash = block_hash
            self._cached[block_hash] = block
            added += 1
            if self.events is not None:
                self.events.stored((block_hash,))
        return added

    def reset_prefix_cache(self) -> int:
        """Forgets every cached hash (owned and free blocks); returns how many were dropped.

        KV contents and reference counts are untouched, so running requests are unaffected; only
        future prefix hits are lost. Changes: the ``hash -> block`` map and ``block_hash`` fields.
        """
        dropped = len(self._cached)
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self.events is not None:
            self.events.cleared()
        return dropped

    def cached_hashes(self) -> list[int]:
        """Every hash in the prefix-cache map (a snapshot, e.g. for a router that joins late)."""
        return list(self._cached)

    def check(self) -> None:
        """Verifies the pool's own invariants. Changes nothing.

        Raises:
            AssertionError: a negative ref count, a free-queue entry with ``ref_cnt != 0`` (or a free
                block missing from it), or a ``hash -> block`` entry disagreeing with the block.
        """
        for block in self.blocks:
            _require(block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}")
            in_free = block.block_id in self._free
            _require(in_free == (block.ref_cnt == 0),
                     f"block {block.block_id}: ref_cnt {block.ref_cnt} but in free queue = {in_free}")
            if block.block_hash is not None:
                _require(self._cached.get(block.block_hash) is block,
                         f"block {block.block_id} has a hash the cache maps elsewhere")
        for block_id, block in self._free.items():
            _require(self.blocks[block_id] is block, f"free queue key {block_id} maps to another block")
        for block_hash, block in self._cached.items():
            _require(block.block_hash == block_hash, f"cache entry for block {block.block_id} is stale")
        _require(self.enable_caching or not self._cached, "prefix cache entries while caching is disabled")
