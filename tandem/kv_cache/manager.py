"""KVCacheManager: the scheduler's only view of the KV cache (block tables + automatic prefix caching).

Each request owns a block table (a list of block ids; token ``p`` sits at slot
``table[p // block_size] * block_size + p % block_size``). Blocks whose KV has been written in full
are registered under their chained hash (``hashing.py``) so a later request with the same prefix
reuses them (vLLM v1 automatic prefix caching; PagedAttention, Kwon et al. 2023).

The life of a block (see ``block_pool.py``):

1. **allocated** by ``allocate_slots`` for a request's next tokens (or for KV that will arrive from
   elsewhere); its content is garbage until written, and it has no hash.
2. **written**: the runner computed its K/V (``cache_written_blocks``, called by the scheduler from
   ``update_from_output`` after the step ran, or once remote KV has landed). Only now does a full
   block get its hash and become a prefix hit. A step that fails never reaches this point, so it
   leaves no hash on a block it did not write.
3. **held**: its request finished but a transfer still reads it (``hold``, under a lease id). A held
   block keeps its reference until ``release`` or lease expiry (``expire_leases``, default 30 s,
   ``renew`` to extend); it is never reused while held.
4. **freed**: ref count 0, in the LRU free queue; it stays hashable until allocation evicts it.

Which calls mutate state: ``allocate_slots``, ``cache_written_blocks``, ``free``, ``hold``, ``renew``,
``release``, ``expire_leases``, ``reset_prefix_cache``. ``get_computed_blocks`` only extends
``request.block_hashes``; the rest are read-only.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

from tandem.kv_cache.block_pool import BlockPool, KVCacheBlock, _require
from tandem.kv_cache.hashing import update_block_hashes
from tandem.kv_cache.leases import DEFAULT_LEASE_TTL_S, LeaseTable
from tandem.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables of the running requests over one ``BlockPool``.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: reuse full blocks of earlier requests with the same prefix.
        lease_ttl_s: default lifetime of a lease on held blocks (seconds).
        clock: monotonic clock in seconds for lease expiry (tests inject a fake one).

    Raises:
        ValueError: ``num_blocks < 1``, ``block_size < 1`` or ``lease_ttl_s <= 0``.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}
        # Leading blocks of each table whose KV is written (registered in the prefix cache when full).
        self._num_cached_blocks: dict[str, int] = {}
        self.leases = LeaseTable(lease_ttl_s, clock)
        self.prefix_cache_queries = 0  # tokens looked up (request.num_tokens per (re)start), cumulative
        self.prefix_cache_hits = 0  # of which served from the cache, cumulative

    @property
    def num_free_blocks(self) -> int:
        """Blocks not owned by any request (cached free blocks count as free)."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by requests (0..1), the ``kv_cache_usage`` metric."""
        return self.block_pool.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits / queries in tokens since start (0.0 before any query)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def request_ids(self) -> set[str]:
        """Ids of the requests that currently own blocks (a new set)."""
        return set(self._req_blocks)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (a copy; empty for an unknown request). Changes nothing."""
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of ``request``: (block ids, number of tokens they hold).

        Only full blocks count, and the hit stops at least one token short of ``request.num_tokens``
        so the last token is computed and gives logits to sample from (vLLM does the same). Returns
        ``([], 0)`` when prefix caching is disabled. Pass the result to ``allocate_slots`` right away:
        the blocks are not reserved until then.

        Changes: extends ``request.block_hashes``; nothing else (hits are counted by ``allocate_slots``).
        """
        if not self.enable_prefix_caching:
            return [], 0
        update_block_hashes(request, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        block_ids: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            block_ids.append(block.block_id)
        return block_ids, len(block_ids) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_block_ids: Sequence[int] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[int] | None:
        """Makes room for ``num_new_tokens`` tokens after the request's computed (and newly hit) tokens.

        The table grows to ``cdiv(num_computed_tokens + num_new_computed_tokens + num_new_tokens,
        block_size)`` blocks: the prefix-hit blocks (from ``get_computed_blocks``, only on a request's
        first allocation since it (re)started) are shared, the rest come from the free queue.
        New blocks are only allocated: they enter the prefix cache once written
        (``cache_written_blocks``), so a request scheduled later in the same step cannot hit them.

        Returns:
            The request's whole block table after allocation, or None when there are not enough free
            blocks; then nothing changed.
        Changes (on success): the request's table, ref counts, free queue (evicting cached blocks
        it reuses), and the prefix-cache counters on a first allocation.
        Raises:
            ValueError: ``num_new_tokens < 1``, a negative hit count, hit blocks not matching
                ``num_new_computed_tokens``, or hit blocks for a request that already owns blocks.
        """
        rid = request.request_id
        self._validate_allocation(request, num_new_tokens, new_computed_block_ids, num_new_computed_tokens)
        owned = self._req_blocks.get(rid, [])
        computed = [self.block_pool.blocks[i] for i in new_computed_block_ids]
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_new_blocks = max(0, cdiv(total, self.block_size) - len(owned) - len(computed))
        # NOTE: hit blocks sitting in the free queue would be counted twice (as free and as reused).
        num_evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_evictable_hits:
            return None
        if rid not in self._req_blocks and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_new_computed_tokens
        self.block_pool.touch(computed)  # before get_new_blocks, so the hits cannot be evicted
        table = self._req_blocks.setdefault(rid, [])
        if computed:
            self._num_cached_blocks[rid] = len(computed)  # hits are written blocks already
        table.extend(computed)
        table.extend(self.block_pool.get_new_blocks(num_new_blocks))
        return [b.block_id for b in table]

    def _validate_allocation(
        self, request: Request, num_new_tokens: int, hit_ids: Sequence[int], num_hit_tokens: int
    ) -> None:
        if num_new_tokens < 1 or num_hit_tokens < 0:
            raise ValueError(f"need num_new_tokens >= 1 and num_new_computed_tokens >= 0, got "
                             f"{num_new_tokens}, {num_hit_tokens}")
        if num_hit_tokens != len(hit_ids) * self.block_size:
            raise ValueError(f"{len(hit_ids)} hit blocks cannot hold {num_hit_tokens} tokens")
        if hit_ids and request.request_id in self._req_blocks:
            raise ValueError(f"request {request.request_id} already owns blocks; prefix hits come first")

    def cache_written_blocks(self, request: Request, num_written_tokens: int | None = None) -> int:
        """Marks the request's tokens ``[0, num_written_tokens)`` as written; returns blocks newly cached.

        ``num_written_tokens`` defaults to ``request.num_computed_tokens`` (call it after the step that
        computed them ran). Every full block among them is registered under its chained hash, so
        later requests can hit it. Changes: ``request.block_hashes`` (extended), the prefix cache map,
        the request's written-block count. No-op without prefix caching or for a request owning no blocks.

        Raises:
            ValueError: ``num_written_tokens`` exceeds the slots of the request's block table.
        """
        rid = request.request_id
        table = self._req_blocks.get(rid)
        if not self.enable_prefix_caching or not table:
            return 0
        written = request.num_computed_tokens if num_written_tokens is None else num_written_tokens
        if written > len(table) * self.block_size:
            raise ValueError(f"request {rid}: {written} written tokens exceed its {len(table)} blocks")
        start = self._num_cached_blocks.get(rid, 0)
        num_full = min(written, request.num_tokens) // self.block_size
        if num_full <= start:
            return 0
        update_block_hashes(request, self.block_size)
        self._num_cached_blocks[rid] = num_full
        return self.block_pool.cache_full_blocks(table[start:num_full], request.block_hashes[start:num_full])

    def free(self, request: Request) -> None:
        """Returns all of the request's blocks at once (no-op if it owns none).

        Blocks go to the free queue tail-first, so a request's last blocks are evicted before its
        first ones (the shared prefix survives longest). Cached blocks stay findable until evicted.
        Changes: ref counts, the free queue, the request's table (removed).
        """
        table = self._req_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if table:
            self.block_pool.free_blocks(reversed(table))

    def reset_prefix_cache(self) -> int:
        """Forgets all prefix-cache entries (e.g. after new weights); returns how many were dropped.

        Owned blocks and their KV are untouched. Changes: the prefix cache map.
        """
        # NOTE: running requests keep their cached-block counts, so their dropped blocks are not
        # re-registered; later full blocks are, and become reachable again once the chain is rebuilt.
        return self.block_pool.reset_prefix_cache()

    # ---- held blocks (leases) -------------------------------------------------------------------

    @property
    def num_held_blocks(self) -> int:
        """Block references owned by leases (a block held by two leases counts twice)."""
        return sum(len(lease.blocks) for lease in self.leases)

    def hold(self, request: Request, lease_id: str, ttl_s: float | None = None) -> list[int]:
        """Pins the blocks of a finished ``request`` under ``lease_id`` instead of freeing them.

        The lease takes over the request's references (ref counts unchanged), so the blocks are never
        reused until ``release(lease_id)`` or the lease expires ``ttl_s`` seconds from now (default
        ``lease_ttl_s``). Written full blocks keep their hashes (prefix hits may share them).
        Returns the held block ids in table order (empty if the request owned none; a lease is still
        recorded). Changes: removes the request's table, adds a lease.

        Raises:
            ValueError: ``lease_id`` is already leased, or ``ttl_s <= 0``.
        """
        lease = self.leases.add(lease_id, self._req_blocks.get(request.request_id, []), ttl_s)
        self._req_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        return lease.block_ids

    def held_block_ids(self, lease_id: str) -> list[int]:
        """The block ids of a lease (changes nothing). Raises ``UnknownLeaseError``."""
        return self.leases.get(lease_id).block_ids

    def block_generations(self, block_ids: Sequence[int]) -> list[int]:
        """The allocation generation of each block (``KVCacheBlock.generation``). Changes nothing."""
        return [self.block_pool.blocks[i].generation for i in block_ids]

    def renew(self, lease_id: str, ttl_s: float | None = None) -> float:
        """Extends a lease to ``ttl_s`` seconds from now; returns the new expiry (clock seconds).

        Changes: the lease's expiry. Raises ``UnknownLeaseError`` (also for an expired lease).
        """
        return self.leases.renew(lease_id, ttl_s)

    def release(self, lease_id: str) -> list[int]:
        """Ends a lease and frees its blocks (last block first, as ``free``); returns their ids.

        Changes: ref counts, the free queue, the lease table. Raises ``UnknownLeaseError``.
        """
        lease = self.leases.pop(lease_id)
        self.block_pool.free_blocks(reversed(lease.blocks))
        return lease.block_ids

    def expire_leases(self) -> list[str]:
        """Releases every lease whose expiry has passed on the clock; returns their ids.

        Changes: as ``release`` for each expired lease.
        """
        expired = self.leases.expired_ids()
        for lease_id in expired:
            self.release(lease_id)
        return expired

    def check(self) -> None:
        """Verifies the invariants (meant for idle moments and tests). Changes nothing.

        Raises:
            AssertionError: a ref count differs from the number of tables and leases holding the
                block (a leak or a double free), a table holds a block twice, a table block past its
                written prefix has a hash (KV not yet written is hashable), or the pool's own
                invariants fail (free queue vs ref 0, stale hash map).
        """
        holders: Counter[int] = Counter()
        for rid, table in self._req_blocks.items():
            ids = [b.block_id for b in table]
            _require(len(set(ids)) == len(ids), f"request {rid} holds a block twice: {ids}")
            holders.update(ids)
            num_written = self._num_cached_blocks.get(rid, 0)
            unwritten = [b.block_id for b in table[num_written:] if b.block_hash is not None]
            _require(not unwritten, f"request {rid}: unwritten blocks {unwritten} have a prefix-cache hash")
        for lease in self.leases:
            holders.update(lease.block_ids)
        for block in self.block_pool.blocks:
            _require(block.ref_cnt == holders[block.block_id],
                     f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {holders[block.block_id]} "
                     f"tables/leases")
        self.block_pool.check()
