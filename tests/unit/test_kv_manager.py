"""KVCacheManager (block tables + automatic prefix caching) and KV sizing; no tensors, no model."""

from __future__ import annotations

import random

import pytest

from tandem.config import CacheConfig, ConfigError
from tandem.kv_cache.manager import KVCacheManager
from tandem.kv_cache.storage import (
    GIB,
    bytes_per_block,
    check_kv_memory,
    kv_cache_shape,
    num_blocks_for_budget,
    plan_num_blocks,
    slot_of,
)
from tandem.request import Request
from tandem.sampling_params import SamplingParams


def make_request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, list(prompt), SamplingParams(), max_tokens=16)


def start(kv: KVCacheManager, req: Request, num_tokens: int | None = None) -> list[int] | None:
    """What the scheduler does for a waiting request: prefix hit, allocate the rest, and (once the
    step ran) mark the computed tokens written."""
    hit_ids, num_hit = kv.get_computed_blocks(req)
    n = (req.num_tokens - num_hit) if num_tokens is None else num_tokens
    table = kv.allocate_slots(req, n, hit_ids, num_hit)
    if table is not None:
        req.num_computed_tokens = num_hit + n
        kv.cache_written_blocks(req)
    return table


def snapshot(kv: KVCacheManager) -> tuple:
    pool = kv.block_pool
    return (
        pool.free_block_ids(),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        {rid: kv.get_block_ids(rid) for rid in kv.request_ids},
        kv.prefix_cache_queries,
        kv.prefix_cache_hits,
    )


# ---- storage ----


def test_num_blocks_for_budget_exact():
    # 2 (K,V) * 30 layers * 16 tokens * 3 heads * 64 dim * 2 bytes = 368_640 bytes per block
    assert bytes_per_block(16, 30, 3, 64, 2) == 368_640
    assert num_blocks_for_budget(1.0, 16, 30, 3, 64, 2) == (1 << 30) // 368_640 == 2912
    assert num_blocks_for_budget(0.5, 16, 30, 3, 64, 4) == (1 << 29) // 737_280 == 728


def test_budget_below_two_blocks_raises():
    per_block = bytes_per_block(16, 30, 3, 64, 2)
    with pytest.raises(ConfigError, match="holds 1 KV block"):
        num_blocks_for_budget(1.5 * per_block / (1 << 30), 16, 30, 3, 64, 2)
    with pytest.raises(ConfigError, match="kv_cache_gib must be > 0"):
        num_blocks_for_budget(0, 16, 30, 3, 64, 2)


def test_plan_num_blocks_shares_the_budget_between_target_and_draft():
    cache = CacheConfig(block_size=16, kv_cache_gib=1.0)
    assert plan_num_blocks(cache, 368_640, 0, max_num_seqs=1000, max_model_len=4096) == 2912
    # a draft of a third of the target's size: each block costs both caches
    assert plan_num_blocks(cache, 368_640, 122_880, 1000, 4096) == GIB // (368_640 + 122_880) == 2184
    assert plan_num_blocks(cache, 368_640, 122_880, max_num_seqs=2, max_model_len=64) == 2 * 2 * 4  # useful cap
    assert plan_num_blocks(CacheConfig(block_size=16, num_blocks=7), 368_640, 122_880, 1, 64) == 7
    with pytest.raises(ConfigError, match="holds 1 KV block.*target \\+ draft caches"):
        plan_num_blocks(CacheConfig(kv_cache_gib=600_000 / GIB), 300_000, 200_000, 1, 64)  # target alone: 2


def test_check_kv_memory_keeps_ten_percent_free():
    assert check_kv_memory(9, 100, available_bytes=1000) == 900
    with pytest.raises(ConfigError, match="the KV cache needs"):
        check_kv_memory(10, 91, available_bytes=1000)


def test_kv_cache_shape_and_slot():
    assert kv_cache_shape(100, 16, 3, 64) == (100, 16, 3, 64)
    with pytest.raises(ConfigError):
        kv_cache_shape(0, 16, 3, 64)
    assert slot_of([7, 2, 9], 0, 4) == 28
    assert slot_of([7, 2, 9], 5, 4) == 9
    assert slot_of([7, 2, 9], 11, 4) == 39


# ---- allocation ----


def test_allocate_grows_table_block_by_block():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    req = make_request("a", list(range(10)))
    assert kv.allocate_slots(req, 10) == [0, 1, 2]
    req.num_computed_tokens = 10
    req.output_token_ids.append(99)
    assert kv.allocate_slots(req, 1) == [0, 1, 2]  # slot 10 is in block 2
    req.num_computed_tokens = 11
    req.output_token_ids.append(98)
    assert kv.allocate_slots(req, 1) == [0, 1, 2]
    req.num_computed_tokens = 12
    req.output_token_ids.append(97)
    assert kv.allocate_slots(req, 1) == [0, 1, 2, 3]
    assert kv.num_free_blocks == 4
    assert kv.usage == pytest.approx(0.5)
    kv.check()


def test_allocation_failure_leaves_state_unchanged():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(12)))
    assert start(kv, a) == [0, 1, 2]
    b = make_request("b", list(range(8)) + [50, 51])  # 2 hit blocks + needs 1 more: fits
    c = make_request("c", list(range(100, 110)))  # needs 3 blocks, only 1 free
    before = snapshot(kv)
    assert start(kv, c) is None
    assert snapshot(kv) == before
    assert kv.get_block_ids("c") == []
    assert start(kv, b) == [0, 1, 3]
    kv.check()


def test_free_returns_everything_tail_first():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    req = make_request("a", list(range(14)))
    assert start(kv, req) == [0, 1, 2, 3]
    assert kv.num_free_blocks == 2
    kv.free(req)
    assert kv.num_free_blocks == 6
    assert kv.get_block_ids("a") == []
    assert kv.block_pool.free_block_ids() == [4, 5, 3, 2, 1, 0]  # tail blocks are evicted first
    kv.free(req)  # a second free is a no-op
    kv.check()


def test_negative_or_inconsistent_arguments_raise():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    req = make_request("a", list(range(8)))
    with pytest.raises(ValueError, match="need num_new_tokens >= 1"):
        kv.allocate_slots(req, 0)
    with pytest.raises(ValueError, match="cannot hold"):
        kv.allocate_slots(req, 4, [0], 3)


# ---- prefix caching ----


def test_prefix_hit_returns_full_blocks_of_identical_prompt_never_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(10)))
    table_a = start(kv, a)
    assert table_a == [0, 1, 2]
    kv.free(a)
    b = make_request("b", list(range(10)))
    assert kv.get_computed_blocks(b) == ([0, 1], 8)  # the partial 3rd block is never shared
    # a prompt of exactly 2 full blocks: the last token must be computed, so only 1 block hits
    c = make_request("c", list(range(8)))
    assert kv.get_computed_blocks(c) == ([0], 4)
    d = make_request("d", list(range(4)))
    assert kv.get_computed_blocks(d) == ([], 0)


def test_prefix_hit_across_requests_with_different_tails():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    a = make_request("a", shared + [1, 2, 3])
    b = make_request("b", shared + [4, 4, 4, 4, 4])
    assert start(kv, a) == [0, 1, 2]
    assert kv.get_computed_blocks(b) == ([0, 1], 8)
    assert start(kv, b) == [0, 1, 3, 4]
    assert b.num_computed_tokens == 13
    assert [kv.block_pool.blocks[i].ref_cnt for i in (0, 1, 2, 3, 4)] == [2, 2, 1, 1, 1]
    assert kv.prefix_cache_queries == 11 + 13
    assert kv.prefix_cache_hits == 8
    assert kv.prefix_cache_hit_rate == pytest.approx(8 / 24)
    kv.free(a)
    assert kv.block_pool.blocks[0].ref_cnt == 1  # still held by b
    # same first block but a different second block: the hit stops at the first miss
    c = make_request("c", shared[:4] + [0, 0, 0, 0, 1])
    assert kv.get_computed_blocks(c) == ([0], 4)
    kv.check()


def test_hit_blocks_in_free_queue_are_not_evicted_by_own_allocation():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(9)))
    assert start(kv, a) == [0, 1, 2]
    kv.free(a)  # free queue: 3, 2, 1, 0 -- all 4 free, blocks 0 and 1 cached
    b = make_request("b", list(range(8)) + list(range(50, 58)) + [1])  # 2 hits + 3 new = 5 > 4
    before = snapshot(kv)
    assert start(kv, b) is None
    assert snapshot(kv) == before
    c = make_request("c", list(range(8)) + list(range(50, 58)))  # 2 hits + 2 new = 4
    assert start(kv, c) == [0, 1, 3, 2]
    kv.check()


def test_blocks_filled_by_decode_are_cached():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6])
    start(kv, a)
    for token in (7, 8, 9):  # decode: the token sampled last step is computed this step
        a.output_token_ids.append(token)
        assert kv.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
        kv.cache_written_blocks(a)
    kv.free(a)
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(b) == ([0, 1], 8)  # block 1 was completed by output token 8


def test_prefix_caching_disabled():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_request("a", list(range(10)))
    start(kv, a)
    kv.free(a)
    b = make_request("b", list(range(10)))
    assert kv.get_computed_blocks(b) == ([], 0)
    assert kv.prefix_cache_queries == 0
    assert kv.block_pool.num_cached_blocks == 0


def test_reset_prefix_cache():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(10)))
    start(kv, a)
    assert kv.reset_prefix_cache() == 2
    kv.free(a)
    assert kv.get_computed_blocks(make_request("b", list(range(10)))) == ([], 0)
    kv.check()


def test_random_walk_keeps_invariants_and_kv_contents():
    """Random starts / chunks / decodes / frees; a fake KV store checks every reused slot's content."""
    rng = random.Random(1234)
    block_size, num_blocks = 4, 12
    kv = KVCacheManager(num_blocks, block_size)
    stores: dict[int, tuple[int, ...]] = {}  # slot -> the token prefix whose last token's KV it holds
    prefixes = [[rng.randrange(50) for _ in range(13)] for _ in range(3)]
    live: dict[str, Request] = {}
    hits = failures = 0
    for step in range(600):
        op = rng.random()
        if op < 0.3 and len(live) < 6:
            tail = [rng.randrange(50) for _ in range(rng.randrange(3))]
            prompt = rng.choice(prefixes)[: rng.randrange(1, 14)] + tail
            req = make_request(f"r{step}", prompt or [1])
            hit_ids, num_hit = kv.get_computed_blocks(req)
            _check_contents(stores, req, hit_ids, num_hit, block_size)
            n = rng.randrange(1, req.num_tokens - num_hit + 1)
            if kv.allocate_slots(req, n, hit_ids, num_hit) is None:
                failures += 1
            else:
                hits += num_hit
                req.num_computed_tokens = num_hit
                _compute(stores, kv, req, n, block_size)
                live[req.request_id] = req
        elif op < 0.8 and live:
            req = live[rng.choice(sorted(live))]
            if req.num_computed_tokens == req.num_tokens:
                req.output_token_ids.append(rng.randrange(50))  # "sampled"
            n = rng.randrange(1, req.num_tokens - req.num_computed_tokens + 1)
            if kv.allocate_slots(req, n) is None:
                failures += 1
            else:
                _compute(stores, kv, req, n, block_size)
        elif live:
            kv.free(live.pop(rng.choice(sorted(live))))
        kv.check()
    for req in live.values():
        kv.free(req)
    kv.check()
    assert kv.num_free_blocks == num_blocks
    assert hits > 0 and kv.prefix_cache_hits == hits
    assert failures > 0  # the walk did run the pool dry


def _compute(stores: dict, kv: KVCacheManager, req: Request, n: int, block_size: int) -> None:
    table = kv.get_block_ids(req.request_id)
    tokens = req.all_token_ids
    for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
        stores[slot_of(table, pos, block_size)] = tuple(tokens[: pos + 1])
    req.num_computed_tokens += n
    kv.cache_written_blocks(req)


def _check_contents(stores: dict, req: Request, hit_ids: list[int], num_hit: int, block_size: int) -> None:
    tokens = req.all_token_ids
    for pos in range(num_hit):
        assert stores[slot_of(hit_ids, pos, block_size)] == tuple(tokens[: pos + 1])
