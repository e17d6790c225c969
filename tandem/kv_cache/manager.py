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

Sliding-window models (vLLM v1's ``SlidingWindowManager.remove_skipped_blocks``): when every layer
attends only to its last ``sliding_window`` tokens (``sliding_window`` set; Mistral), a block wholly
before ``num_computed_tokens - sliding_window + 1`` is read by no future query. ``allocate_slots``
frees such blocks first (last one first, so the shared prefix survives longest in the LRU queue) and
leaves ``SKIPPED_BLOCK_ID`` in their place in the table, so token ``p`` still sits in
``table[p // block_size]``. A freed block only loses this request's reference: a prefix block that
another request shares stays owned (ref counts), and a freed block keeps its hash (its KV is still
right for that prefix) until allocation reuses it, which removes the hash first (``BlockPool``).
Prefix-hit blocks already out of the window are not taken at all. Requests whose KV is transferred
(``request.kv_lease_id``) keep every block, since the receiver needs them all.

Models mixing sliding and full-attention layers (Gemma 2/3, Qwen2 with ``max_window_layers``) free
nothing before the request ends: one block holds a token's K/V for *every* layer, so a block is
needed while any full-attention layer can read it, i.e. always. Freeing per layer group needs one
block table and one pool per group (vLLM's ``HybridKVCacheCoordinator`` with a cache tensor per
group); this manager keeps one table per request over one pool.

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

SKIPPED_BLOCK_ID = -1  # a table entry whose block was freed: wholly outside every layer's sliding window


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
        sliding_window: tokens every layer attends back to (all layers slide; the model runner's
            ``kv_window``): blocks out of it are freed while the request runs. None: kept to the end.

    Raises:
        ValueError: ``num_blocks < 1``, ``block_size < 1``, ``sliding_window < 1`` or ``lease_ttl_s <= 0``.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S, clock: Callable[[], float] = time.monotonic,
        sliding_window: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.sliding_window = sliding_window
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self._req_blocks: dict[str, list[KVCacheBlock | None]] = {}  # None: freed, out of the window
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
        """The request's block table (a copy; empty for an unknown request; ``SKIPPED_BLOCK_ID`` where a
        block out of the sliding window was freed). Changes nothing."""
        return _ids(self._req_blocks.get(request_id, ()))

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
        With ``sliding_window``, the blocks wholly before the window of the first token to compute are
        freed first (hit blocks there are not taken) and read ``SKIPPED_BLOCK_ID`` in the table.

        Returns:
            The request's whole block table after allocation, or None when there are not enough free
            blocks; then nothing changed but the freeing of blocks out of the window.
        Changes (on success): the request's table, ref counts, free queue (evicting cached blocks
        it reuses), and the prefix-cache counters on a first allocation.
        Raises:
            ValueError: ``num_new_tokens < 1``, a negative hit count, hit blocks not matching
                ``num_new_computed_tokens``, or hit blocks for a request that already owns blocks.
        """
        rid = request.request_id
        self._validate_allocation(request, num_new_tokens, new_computed_block_ids, num_new_computed_tokens)
        owned = self._req_blocks.get(rid, [])
        start = request.num_computed_tokens + num_new_computed_tokens
        num_skipped = self._num_skipped(request, start)
        self._free_skipped(owned, num_skipped)
        computed: list[KVCacheBlock | None] = [self.block_pool.blocks[i] for i in new_computed_block_ids]
        computed[:num_skipped] = [None] * min(num_skipped, len(computed))  # hits already out of the window
        kept_hits = [b for b in computed if b is not None]
        num_new_blocks = max(0, cdiv(start + num_new_tokens, self.block_size) - len(owned) - len(computed))
        # NOTE: hit blocks sitting in the free queue would be counted twice (as free and as reused).
        num_evictable_hits = sum(1 for b in kept_hits if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_evictable_hits:
            return None
        if rid not in self._req_blocks and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_new_computed_tokens
        self.block_pool.touch(kept_hits)  # before get_new_blocks, so the hits cannot be evicted
        table = self._req_blocks.setdefault(rid, [])
        if computed:
            self._num_cached_blocks[rid] = len(computed)  # hits are written blocks already
        table.extend(computed)
        table.extend(self.block_pool.get_new_blocks(num_new_blocks))
        return _ids(table)

    def _num_skipped(self, request: Request, start: int) -> int:
        """Leading blocks no query from token ``start`` on reads: wholly before ``start - window + 1``."""
        if self.sliding_window is None or request.kv_lease_id is not None:
            return 0  # NOTE: a request whose KV is leased to a transfer keeps all of it for the receiver
        return max(0, start - self.sliding_window + 1) // self.block_size

    def _free_skipped(self, table: list[KVCacheBlock | None], num_skipped: int) -> None:
        """Frees ``table[:num_skipped]`` (last first, down to the first entry already freed) and leaves
        None there. Changes: the table, ref counts, the free queue."""
        freed: list[KVCacheBlock] = []
        for i in range(min(num_skipped, len(table)) - 1, -1, -1):
            block = table[i]
            if block is None:
                break  # NOTE: skipped entries are a leading run, freed by earlier calls
            freed.append(block)
            table[i] = None
        self.block_pool.free_blocks(freed)

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
        # NOTE: a block out of the sliding window freed before it was registered (remote KV without
        # prefix caching first) stays unregistered; its KV may already be someone else's.
        pairs = [(b, h) for b, h in zip(table[start:num_full], request.block_hashes[start:num_full], strict=True)
                 if b is not None]
        return self.block_pool.cache_full_blocks([b for b, _ in pairs], [h for _, h in pairs])

    def free(self, request: Request) -> None:
        """Returns all of the request's blocks at once (no-op if it owns none).

        Blocks go to the free queue tail-first, so a request's last blocks are evicted before its
        first ones (the shared prefix survives longest). Cached blocks stay findable until evicted.
        Changes: ref counts, the free queue, the request's table (removed).
        """
        table = self._req_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if table:
            self.block_pool.free_blocks(b for b in reversed(table) if b is not None)

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
        table = self._req_blocks.get(request.request_id, [])
        lease = self.leases.add(lease_id, [b for b in table if b is not None], ttl_s)
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
                block (a leak or a double free), a table holds a block twice or has freed (out of the
                window) entries after live ones or without a window, a table block past its
                written prefix has a hash (KV not yet written is hashable), or the pool's own
                invariants fail (free queue vs ref 0, stale hash map).
        """
        holders: Counter[int] = Counter()
        for rid, table in self._req_blocks.items():
            num_skipped = next((i for i, b in enumerate(table) if b is not None), len(table))
            _require(None not in table[num_skipped:], f"request {rid}: freed entries after live ones")
            _require(not num_skipped or self.sliding_window is not None, f"request {rid}: freed entries, no window")
            ids = [b.block_id for b in table[num_skipped:]]
            _require(len(set(ids)) == len(ids), f"request {rid} holds a block twice: {ids}")
            holders.update(ids)
            num_written = self._num_cached_blocks.get(rid, 0)
            unwritten = [b.block_id for b in table[max(num_written, num_skipped):] if b.block_hash is not None]
            _require(not unwritten, f"request {rid}: unwritten blocks {unwritten} have a prefix-cache hash")
        for lease in self.leases:
            holders.update(lease.block_ids)
        for block in self.block_pool.blocks:
            _require(block.ref_cnt == holders[block.block_id],
                     f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {holders[block.block_id]} "
                     f"tables/leases")
        self.block_pool.check()


def _ids(table: Sequence[KVCacheBlock | None]) -> list[int]:
    return [SKIPPED_BLOCK_ID if b is None else b.block_id for b in table]
