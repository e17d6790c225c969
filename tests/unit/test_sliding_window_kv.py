"""Blocks out of every layer's sliding window are freed while a request runs (vLLM v1's
``remove_skipped_blocks``), model-free: exact free-block counts, prefix-cache sharing and hash
eviction on reuse, and a scheduler run whose fake runner checks every key a query can see.
"""

from __future__ import annotations

import pytest

from tandem.config import CacheConfig, SchedulerConfig
from tandem.kv_cache.manager import SKIPPED_BLOCK_ID, KVCacheManager
from tandem.kv_cache.storage import slot_of
from tandem.outputs import ModelRunnerOutput, SchedulerOutput
from tandem.request import Request
from tandem.sampling_params import SamplingParams
from tandem.scheduler import Scheduler

WINDOW = 16


def _request(rid: str, prompt: list[int], max_tokens: int = 8, lease: str | None = None) -> Request:
    request = Request(rid, list(prompt), SamplingParams(), max_tokens=max_tokens)
    request.kv_lease_id = lease
    return request


def _advance(kv: KVCacheManager, request: Request, n: int, hit: tuple[list[int], int] = ([], 0)) -> list[int]:
    """Allocates ``n`` tokens after the computed ones (after a prefix hit), then marks them written."""
    table = kv.allocate_slots(request, n, *hit)
    assert table is not None
    request.num_computed_tokens += hit[1] + n
    kv.cache_written_blocks(request)
    kv.check()
    return table


def test_prefill_chunks_and_decode_free_the_blocks_out_of_the_window() -> None:
    """Block size 4, window 16, 64 blocks: a 70-token prompt in chunks of 16, then decode. Before
    computing from token c the request keeps blocks from (c - 15) // 4 on."""
    kv = KVCacheManager(64, 4, sliding_window=WINDOW)
    request = _request("a", list(range(100, 170)), max_tokens=16)
    free, live = [], []
    for n in (16, 16, 16, 16, 6, 1, 1, 1, 1, 1):
        if n == 1:
            request.output_token_ids.append(7)
        table = _advance(kv, request, n)
        free.append(kv.num_free_blocks)
        live.append(sum(b != SKIPPED_BLOCK_ID for b in table))
    # c = 0, 16: nothing out of the window; c = 32: blocks 0-3 freed; c = 48: 0-7; c = 64: 0-11;
    # decode c = 70: 0-12 (keys 55..70 span 5 blocks), c = 71: 0-13 (keys 56..71 span 4), ...
    assert live == [4, 8, 8, 8, 6, 5, 4, 5, 5, 5]
    assert free == [60, 56, 56, 56, 58, 59, 60, 59, 59, 59]
    assert kv.get_block_ids("a")[:14] == [SKIPPED_BLOCK_ID] * 14 and SKIPPED_BLOCK_ID not in kv.get_block_ids("a")[14:]
    kv.free(request)
    assert kv.num_free_blocks == 64
    kv.check()


def test_without_window_or_with_a_kv_lease_every_block_stays() -> None:
    for kv, lease in ((KVCacheManager(64, 4), None), (KVCacheManager(64, 4, sliding_window=WINDOW), "lease-1")):
        request = _request("a", list(range(100, 170)), lease=lease)
        for n in (32, 32, 6):
            _advance(kv, request, n)
        assert kv.num_free_blocks == 64 - 18 and SKIPPED_BLOCK_ID not in kv.get_block_ids("a")
        kv.free(request)
        assert kv.num_free_blocks == 64


def test_shared_prefix_blocks_stay_owned_and_reused_blocks_lose_their_hash() -> None:
    kv = KVCacheManager(24, 4, sliding_window=WINDOW)
    prompt_a = list(range(100, 140))  # 10 full blocks
    a = _request("a", prompt_a)
    _advance(kv, a, 40)
    assert kv.num_free_blocks == 14
    hashes_a = list(a.block_hashes)
    # b shares a's first 32 tokens: a hit of 8 blocks, of which 0-3 are already out of b's window
    b = _request("b", prompt_a[:32] + list(range(900, 908)))
    hit = kv.get_computed_blocks(b)
    assert hit == (kv.get_block_ids("a")[:8], 32)
    table_b = _advance(kv, b, 8, hit)
    assert table_b[:4] == [SKIPPED_BLOCK_ID] * 4 and table_b[4:8] == kv.get_block_ids("a")[4:8]
    assert kv.num_free_blocks == 12  # b took 2 new blocks; the 4 blocks it shares count once
    # a decodes from token 40: its blocks 0-5 leave its window; 4 and 5 are still b's
    a.output_token_ids.append(7)
    table_a = _advance(kv, a, 1)
    shared = table_b[4:6]
    assert [kv.block_pool.blocks[i].ref_cnt for i in shared] == [1, 1]
    assert not set(shared) & set(kv.block_pool.free_block_ids())
    assert kv.num_free_blocks == 15  # a's blocks 0-3 are free, its 4 and 5 are not; 1 new for token 40
    # a new request takes every free block: a's freed ones are reused, their hashes leave the cache
    first_a = kv.block_pool.get_cached_block(hashes_a[0]).block_id
    c = _request("c", list(range(500, 560)))
    _advance(kv, c, 60)
    assert kv.num_free_blocks == 0 and first_a in kv.get_block_ids("c")
    assert all(kv.block_pool.get_cached_block(h) is None for h in hashes_a[:4])
    assert kv.get_computed_blocks(_request("d", prompt_a)) == ([], 0)  # the chain starts at a reused block
    assert table_a[6:10] == kv.get_block_ids("a")[6:10]
    for request in (a, b, c):
        kv.free(request)
    assert kv.num_free_blocks == 24
    kv.check()


class WindowRunner:
    """A fake runner playing the KV cache: each computed slot holds the token prefix it was computed
    for, and every query checks the slots of all keys in its window (positions p - 15 .. p - 1)."""

    def __init__(self) -> None:
        self.history: dict[str, list[int]] = {}
        self.slots: dict[int, tuple[int, ...]] = {}
        self.num_checked_keys = 0

    def execute(self, out: SchedulerOutput, block_size: int) -> ModelRunnerOutput:
        for new in out.new_requests:
            self.history[new.request_id] = new.prompt_token_ids + new.output_token_ids
        for row in out.scheduled:
            tokens, start = self.history[row.request_id], row.num_computed_tokens
            for pos in range(start, start + len(row.token_ids)):
                self.slots[slot_of(row.block_ids, pos, block_size)] = tuple(tokens[: pos + 1])
        for row in out.scheduled:
            tokens, start = self.history[row.request_id], row.num_computed_tokens
            for pos in range(max(0, start - WINDOW + 1), start):
                assert self.slots[slot_of(row.block_ids, pos, block_size)] == tuple(tokens[: pos + 1])
                self.num_checked_keys += 1
        sampled = {row.request_id: [7] for row in out.scheduled if row.sample}
        for rid, ids in sampled.items():
            self.history[rid].extend(ids)
        return ModelRunnerOutput(sampled_token_ids=sampled)


@pytest.mark.parametrize("block_size", [4, 16])
def test_scheduler_frees_out_of_window_blocks_and_keeps_the_window_intact(block_size: int) -> None:
    """Six 70-token requests with shared prefixes, 20-token budget, a pool too small for all of them
    without freeing: the window's keys are always this request's own, and nothing leaks."""
    num_blocks = 96 // block_size + 2
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=20, max_num_seqs=6), CacheConfig(block_size=block_size),
                      num_blocks=num_blocks, max_model_len=256, sliding_window=WINDOW)
    runner = WindowRunner()
    base = list(range(1000, 1048))
    requests = [_request(f"r{i}", base[: 16 * (i % 3 + 1)] + list(range(2000 + 100 * i, 2070 - 16 * (i % 3 + 1)
                                                                        + 100 * i)), max_tokens=12) for i in range(6)]
    for request in requests:
        sched.add_request(request)
    min_free = num_blocks
    for _ in range(400):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out, block_size))
        sched.check()
        min_free = min(min_free, sched.kv_cache_manager.num_free_blocks)
    assert not sched.has_unfinished_requests()
    assert [len(r.output_token_ids) for r in requests] == [12] * 6
    assert sched.kv_cache_manager.num_free_blocks == num_blocks and min_free < num_blocks // 2
    assert runner.num_checked_keys > 6 * 70


def test_attention_metadata_reads_freed_entries_as_block_0_and_never_writes_them() -> None:
    from tandem.attention import AttentionMetadata

    meta = AttentionMetadata.build([20], [1], [[SKIPPED_BLOCK_ID, SKIPPED_BLOCK_ID, 7, 3, 9, 5]], 4)
    assert meta.block_tables.tolist() == [[0, 0, 7, 3, 9, 5]]
    assert meta.slot_mapping.tolist() == [5 * 4 + 0]
    with pytest.raises(ValueError, match="freed out of the sliding window"):
        AttentionMetadata.build([4], [1], [[7, SKIPPED_BLOCK_ID]], 4)
