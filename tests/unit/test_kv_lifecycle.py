"""The life of a KV block, model-free: allocated -> written (hashable) -> held (lease) -> freed.

Uses ``test_scheduler``'s fake runner, which plays the KV cache (each slot holds the prefix whose
last token's KV it stores) and checks every reused slot's content.
"""

from __future__ import annotations

import pytest
from test_scheduler import FakeRunner, make_request, make_scheduler, step

from tandem.errors import ContextLengthExceededError, DuplicateRequestError
from tandem.kv_cache.leases import UnknownLeaseError
from tandem.kv_cache.manager import KVCacheManager
from tandem.kv_cache.storage import slot_of
from tandem.request import RequestStatus


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pool_state(sched) -> tuple:
    pool = sched.kv_cache_manager.block_pool
    return sorted(pool.free_block_ids()), [(b.ref_cnt, b.block_hash) for b in pool.blocks]


# ---- written before hashable; failed steps ----


def test_blocks_become_hashable_only_after_the_step_ran():
    sched, runner = make_scheduler(block_size=4), FakeRunner()
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    sched.add_request(make_request("a", prompt))
    out = sched.schedule()
    kv = sched.kv_cache_manager
    # NOTE: before the fix, both full blocks were hashed here, at allocation, before any KV existed.
    assert kv.block_pool.num_cached_blocks == 0
    assert kv.get_computed_blocks(make_request("probe", list(prompt))) == ([], 0)
    sched.update_from_output(out, runner.execute(out, sched.block_size))
    assert kv.block_pool.num_cached_blocks == 2
    assert kv.get_computed_blocks(make_request("probe2", list(prompt))) == (out.scheduled[0].block_ids[:2], 8)
    sched.check()


def test_failed_step_leaves_the_cache_as_if_it_never_ran():
    sched, runner = make_scheduler(block_size=4, num_blocks=16), FakeRunner()
    sched.add_request(make_request("old", list(range(200, 209))))
    step(sched, runner)  # "old" is now decoding with 2 written, hashed blocks
    before = pool_state(sched)
    old_table = sched.kv_cache_manager.get_block_ids("old")
    prompt = list(range(100, 113))
    sched.add_request(make_request("a", prompt))
    out = sched.schedule()  # old decodes, a prefills
    assert {r.request_id for r in out.scheduled} == {"old", "a"}
    # The runner raised before writing anything: roll the step back.
    assert sched.abort_step(out) == ["old", "a"]
    assert sched.requests == {} and sched.num_running == 0
    sched.check()
    free_after, blocks_after = pool_state(sched)
    assert free_after == list(range(16))  # every block is free again
    # The only hashes left are the two blocks "old" wrote in the step that did run.
    assert [i for i, (_, h) in enumerate(blocks_after) if h is not None] == sorted(old_table[:2])
    assert [h for _, h in blocks_after if h is not None] == [h for _, h in before[1] if h is not None]
    assert sched.kv_cache_manager.get_computed_blocks(make_request("b", list(prompt))) == ([], 0)
    assert sched.schedule().finished_request_ids == {"old", "a"}  # the runner drops their state


# ---- held blocks and leases ----


def test_held_blocks_are_never_reused_before_release():
    clock = FakeClock()
    sched, runner = make_scheduler(block_size=4, num_blocks=6, budget=64), FakeRunner()
    sched.kv_cache_manager.leases.clock = clock
    held = make_request("p", list(range(100, 111)), max_tokens=1)  # 11 tokens: 3 blocks
    held.kv_lease_id = "lease-p"
    sched.add_request(held)
    step(sched, runner)
    kv = sched.kv_cache_manager
    assert held.status is RequestStatus.FINISHED_LENGTH
    held_ids = kv.held_block_ids("lease-p")
    assert len(held_ids) == 3 and kv.num_free_blocks == 3 and kv.num_held_blocks == 3
    assert sched.make_stats().num_held_blocks == 3
    big = make_request("big", 20, max_tokens=1)  # needs 5 blocks: only 3 are not held
    sched.add_request(big)
    for _ in range(3):
        out, _ = step(sched, runner)
        assert out.scheduled == [] and big.status is RequestStatus.WAITING
    assert kv.release("lease-p") == list(held_ids)
    out, _ = step(sched, runner)
    assert [r.request_id for r in out.scheduled] == ["big"]
    with pytest.raises(UnknownLeaseError):
        kv.renew("lease-p")


def test_lease_expires_after_its_ttl_and_renew_extends_it():
    clock = FakeClock()
    kv = KVCacheManager(num_blocks=8, block_size=4, lease_ttl_s=30.0, clock=clock)
    req = make_request("a", list(range(10)))
    assert kv.allocate_slots(req, 10) == [0, 1, 2]
    assert kv.hold(req, "L") == [0, 1, 2]
    assert kv.request_ids == set() and kv.num_free_blocks == 5
    kv.check()
    clock.now += 29.0
    assert kv.expire_leases() == [] and kv.num_free_blocks == 5
    assert kv.renew("L") == clock.now + 30.0  # 30 s from now again
    clock.now += 29.0
    assert kv.expire_leases() == [] and kv.num_free_blocks == 5
    clock.now += 1.0
    assert kv.expire_leases() == ["L"] and kv.num_free_blocks == 8
    assert kv.num_held_blocks == 0
    kv.check()
    with pytest.raises(ValueError, match="ttl must be > 0"):
        kv.hold(make_request("b", [1]), "M", ttl_s=0)
    assert "M" not in kv.leases


def test_aborted_request_is_not_held():
    sched, runner = make_scheduler(block_size=4, num_blocks=8), FakeRunner()
    req = make_request("a", 10, max_tokens=5)
    req.kv_lease_id = "L"
    sched.add_request(req)
    step(sched, runner)
    sched.abort_requests(["a"])
    assert len(sched.kv_cache_manager.leases) == 0 and sched.kv_cache_manager.num_free_blocks == 8


# ---- KV from elsewhere ----


def test_remote_kv_request_waits_without_blocking_and_then_decodes():
    sched, runner = make_scheduler(block_size=4, num_blocks=16, max_seqs=4), FakeRunner()
    prompt = list(range(300, 310))
    remote = make_request("remote", list(prompt), max_tokens=2)
    table = sched.add_remote_kv_request(remote, 8)
    assert table is not None and len(table) == 2 and remote.status is RequestStatus.WAITING_FOR_REMOTE_KV
    sched.add_request(make_request("local", 5, max_tokens=2))
    out, _ = step(sched, runner)
    assert [r.request_id for r in out.scheduled] == ["local"]  # not blocked by the waiting one
    assert sched.kv_cache_manager.block_pool.num_cached_blocks == 1  # local's block; remote's unwritten
    # The "connector" writes the first 8 tokens' KV into the remote request's blocks.
    for pos in range(8):
        runner.slots[slot_of(table, pos, 4)] = tuple(prompt[: pos + 1])
    sched.mark_remote_kv_ready("remote")
    assert remote.status is RequestStatus.WAITING and remote.num_computed_tokens == 8
    out, _ = step(sched, runner)
    row = next(r for r in out.scheduled if r.request_id == "remote")
    assert (row.num_computed_tokens, row.token_ids, row.block_ids[:2]) == (8, prompt[8:], table)
    assert out.new_requests[0].request_id == "remote"
    assert sched.kv_cache_manager.get_computed_blocks(make_request("same", list(prompt))) == (table, 8)
    while sched.has_unfinished_requests():
        step(sched, runner)
    assert remote.output_token_ids == [7, 7]
    assert sched.kv_cache_manager.num_free_blocks == 16


def test_remote_kv_request_errors_and_abort():
    sched = make_scheduler(block_size=4, num_blocks=4)
    with pytest.raises(ValueError, match=r"num_remote_tokens must be in \[1, 9\]"):
        sched.add_remote_kv_request(make_request("a", 10), 10)
    assert sched.add_remote_kv_request(make_request("c", 10), 8) is not None  # 2 of the 4 blocks
    assert sched.add_remote_kv_request(make_request("b", 13), 12) is None  # 3 blocks: not now
    assert set(sched.requests) == {"c"} and sched.kv_cache_manager.num_free_blocks == 2
    with pytest.raises(KeyError):
        sched.mark_remote_kv_ready("nobody")
    sched.abort_requests(["c"])  # a transfer may still be writing its blocks: they stay held
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == 2 and sched.remote_kv_tokens == {} and sched.requests == {}
    sched.check()
    kv.release("aborted-remote:c")
    assert kv.num_free_blocks == 4
    sched.check()
    leased = make_request("d", 5)
    leased.kv_lease_id = "L"
    kv.hold(make_request("e", 3), "L")
    with pytest.raises(ValueError, match="KV lease 'L' is already in use"):
        sched.add_request(leased)


# ---- integrity checks ----


def test_check_catches_a_planted_leak_and_an_unwritten_hash():
    sched, runner = make_scheduler(block_size=4, num_blocks=8), FakeRunner()
    sched.add_request(make_request("a", 6, max_tokens=4))
    step(sched, runner)
    sched.check()
    kv = sched.kv_cache_manager
    (leaked,) = kv.block_pool.get_new_blocks(1)  # a reference nobody accounts for
    with pytest.raises(AssertionError, match=rf"block {leaked.block_id}: ref_cnt 1, held by 0"):
        sched.check()
    kv.block_pool.free_blocks([leaked])
    sched.check()
    second = kv.block_pool.blocks[kv.get_block_ids("a")[1]]  # tokens 4..7: not written yet
    kv.block_pool.cache_full_blocks([second], [12345])
    with pytest.raises(AssertionError, match=r"unwritten blocks \[\d+\] have a prefix-cache hash"):
        sched.check()


# ---- typed errors ----


def test_duplicate_id_and_too_long_prompt_are_typed_errors():
    sched = make_scheduler(block_size=4, num_blocks=64, max_model_len=32)
    sched.add_request(make_request("a", 4))
    with pytest.raises(DuplicateRequestError, match="'a' is already in the scheduler") as dup:
        sched.add_request(make_request("a", 4))
    assert isinstance(dup.value, ValueError) and dup.value.request_id == "a"
    with pytest.raises(ContextLengthExceededError) as long:
        sched.add_request(make_request("b", 40))
    assert (long.value.num_tokens, long.value.max_model_len, long.value.code) == (40, 32, "context_length_exceeded")
    assert isinstance(long.value, ValueError)


def test_lease_expiry_heap_follows_renewals_and_releases():
    from tandem.kv_cache.leases import LeaseTable

    now = [0.0]
    table = LeaseTable(10.0, lambda: now[0])
    for i in range(5):
        now[0] = float(i)
        table.add(f"l{i}", [])  # expires at i + 10
    table.renew("l0")  # now 4: expires at 14
    table.pop("l1")  # released: its heap entry is stale
    now[0] = 12.5
    assert table.expired_ids() == ["l2"]  # l0 was renewed, l1 released, l3/l4 not due
    table.pop("l2")
    now[0] = 14.0
    assert table.expired_ids() == ["l3", "l0", "l4"]  # soonest first (ties by id), each once
    assert table.expired_ids() == []
