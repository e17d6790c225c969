"""Routing policies and block indexes on hand-made loads and KV events (no model, no I/O)."""

import pytest

from tandem.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, hash_to_bytes
from tandem.kv_cache.hashing import hash_token_blocks
from tandem.router.kv_index import ApproxBlockIndex, EventBlockIndex
from tandem.router.policy import (
    AllBackendsFullError,
    BackendState,
    KVAwarePolicy,
    NoHealthyBackendError,
    make_policy,
)

BS = 4
SYSTEM = list(range(100, 116))  # 4 full blocks
PROMPT = hash_token_blocks(SYSTEM + [1, 2, 3, 4], BS)  # 5 blocks, the first 4 shared with SYSTEM


def _stored(hashes):
    return BlockStored(block_hashes=[hash_to_bytes(h) for h in hashes], block_size=BS)


def _batch(*events):
    return KVEventBatch(ts=0.0, events=list(events), engine_id="e")


def _backends(n=2, events=True):
    return [BackendState(f"b{i}", index=EventBlockIndex() if events else ApproxBlockIndex()) for i in range(n)]


def test_round_robin_cycles_and_skips_ineligible():
    bs = _backends(3)
    p = make_policy("round-robin")
    assert [p.choose([], bs).name for _ in range(4)] == ["b0", "b1", "b2", "b0"]
    bs[1].healthy = False
    bs[2].max_outstanding = 1
    bs[2].outstanding_requests = 1
    assert [p.choose([], bs).name for _ in range(2)] == ["b0", "b0"]


def test_round_robin_retry_does_not_move_the_cursor():
    bs = _backends(3)
    p = make_policy("round-robin")
    first = p.choose([], bs)
    retry = p.choose([], bs, exclude=[first], retry=True)
    assert (first.name, retry.name) == ("b0", "b1")
    assert [p.choose([], bs).name for _ in range(3)] == ["b1", "b2", "b0"]  # first choices stay even


def test_least_load_counts_tokens_on_dispatch_and_completion():
    bs = _backends(2)
    p = make_policy("least-load")
    t0 = p.on_dispatch(p.choose([], bs), [], 100)
    assert t0.backend.name == "b0" and bs[0].outstanding_tokens == 100
    t1 = p.on_dispatch(p.choose([], bs), [], 30)
    assert t1.backend.name == "b1"
    assert p.choose([], bs).name == "b1"  # 30 < 100 tokens
    p.on_complete(t0)
    p.on_complete(t0)  # a second completion of one ticket changes nothing
    assert (bs[0].outstanding_requests, bs[0].outstanding_tokens) == (0, 0)
    assert p.choose([], bs).name == "b0"


def test_kv_aware_prefers_the_backend_holding_the_prefix_despite_load():
    bs = _backends(2)
    bs[1].index.apply(0, _batch(_stored(PROMPT[:4])))
    bs[1].outstanding_tokens = 500  # the busiest; relative load 1.0
    bs[0].outstanding_tokens = 100
    p = make_policy("kv-aware", beta=0.5)
    assert p.scores(PROMPT, bs) == pytest.approx([0.0 - 0.5 * 0.2, 0.8 - 0.5])
    assert p.choose(PROMPT, bs).name == "b1"
    assert p.choose(hash_token_blocks([7] * 20, BS), bs).name == "b0"  # no hit anywhere: the lighter one
    # with a heavy beta the load wins over the 80% hit
    assert KVAwarePolicy(beta=2.0).choose(PROMPT, bs).name == "b0"


def test_kv_aware_counts_only_the_leading_run_of_blocks():
    bs = _backends(2)
    bs[0].index.apply(0, _batch(_stored(PROMPT[1:])))  # everything but block 0: no usable prefix
    bs[1].index.apply(0, _batch(_stored(PROMPT[:1])))
    assert bs[0].index.match(PROMPT) == 0 and bs[1].index.match(PROMPT) == 1
    assert make_policy("kv-aware", min_match=0.0).choose(PROMPT, bs).name == "b1"


def test_a_match_below_min_match_counts_as_none_and_load_decides():
    bs = _backends(2)
    bs[0].index.apply(0, _batch(_stored(PROMPT[:1])))  # 1 of 5 blocks (0.2): a chat template's first block
    bs[0].outstanding_tokens = 110
    bs[1].outstanding_tokens = 100
    default = make_policy("kv-aware")  # min_match 0.3, beta 0.5
    assert default.scores(PROMPT, bs) == pytest.approx([-0.5, -0.5 * 100 / 110])
    assert default.choose(PROMPT, bs).name == "b1"  # what least-load picks
    assert make_policy("least-load").choose(PROMPT, bs).name == "b1"
    # without the threshold the 0.2 match outweighs the 9% load difference
    assert make_policy("kv-aware", min_match=0.0).choose(PROMPT, bs).name == "b0"
    # at or above the threshold the match counts again: 2 of 5 blocks = 0.4
    bs[0].index.apply(1, _batch(_stored(PROMPT[1:2])))
    assert default.scores(PROMPT, bs) == pytest.approx([0.4 - 0.5, -0.5 * 100 / 110])
    assert default.choose(PROMPT, bs).name == "b0"
    assert make_policy("kv-aware", min_match=0.5).choose(PROMPT, bs).name == "b1"


def test_eviction_events_lower_the_score():
    bs = _backends(2)
    bs[0].index.apply(0, _batch(_stored(PROMPT)))
    bs[1].index.apply(0, _batch(_stored(PROMPT[:2])))
    p = make_policy("kv-aware", min_match=0.0)
    assert p.scores(PROMPT, bs) == [1.0, 0.4]
    bs[0].index.apply(1, _batch(BlockRemoved(block_hashes=[hash_to_bytes(PROMPT[1])])))
    assert p.scores(PROMPT, bs) == [0.2, 0.4]
    assert p.choose(PROMPT, bs).name == "b1"
    bs[1].index.apply(1, _batch(AllBlocksCleared()))
    assert p.scores(PROMPT, bs) == [0.2, 0.0]


def test_a_seq_gap_clears_the_index_and_later_events_rebuild_it():
    idx = EventBlockIndex()
    assert idx.apply(5, _batch(_stored(PROMPT)))  # the first message sets the expected seq
    assert idx.apply(6, _batch(_stored(PROMPT[:1])))
    assert idx.match(PROMPT) == 5
    assert not idx.apply(8, _batch(_stored(PROMPT[:2])))  # seq 7 was lost
    assert idx.gaps == 1 and idx.blocks == set(PROMPT[:2]) and idx.next_seq == 9
    assert idx.apply(9, _batch()) and idx.match(PROMPT) == 2


def test_a_snapshot_replaces_the_set_and_older_batches_are_skipped():
    idx = EventBlockIndex()
    idx.apply(3, _batch(_stored(PROMPT[:1])))
    idx.load_snapshot(10, _batch(AllBlocksCleared(), _stored(PROMPT[:3])))
    assert idx.blocks == set(PROMPT[:3]) and idx.next_seq == 10
    assert idx.apply(8, _batch(BlockRemoved(block_hashes=[hash_to_bytes(PROMPT[0])])))  # queued before: moot
    assert idx.match(PROMPT) == 3 and idx.gaps == 0
    assert idx.apply(10, _batch(_stored(PROMPT[3:])))
    assert idx.match(PROMPT) == 5
    assert not idx.apply(0, _batch())  # a lower seq afterwards: the engine restarted
    assert idx.blocks == set() and idx.gaps == 1


def test_pending_dispatch_counts_until_grace_after_completion():
    now = [0.0]
    bs = [BackendState("b0", index=EventBlockIndex(pending_grace_s=2.0, clock=lambda: now[0])),
          BackendState("b1", index=EventBlockIndex())]
    p = make_policy("kv-aware")
    t = p.on_dispatch(p.choose(PROMPT, bs), PROMPT, 20)
    assert t.backend.name == "b0" and t.matched_blocks == 0
    # a second request with the prefix follows the first although its events have not arrived
    assert p.choose(PROMPT, bs).name == "b0"
    p.on_complete(t)
    now[0] = 1.9
    assert bs[0].index.match(PROMPT) == 5
    now[0] = 2.1
    assert bs[0].index.match(PROMPT) == 0  # no BlockStored came: the guess is dropped


def test_approx_index_lru_evicts_leaves_first_and_shrinks_on_a_smaller_hit():
    idx = ApproxBlockIndex(capacity_blocks=6)
    other = hash_token_blocks([9] * 8, BS)  # 2 blocks
    idx.on_dispatch(PROMPT)  # 5 blocks
    assert idx.match(PROMPT) == 5
    idx.on_dispatch(other)  # 7 > 6: the oldest entry goes, PROMPT's leaf (its root was touched last)
    assert len(idx) == 6 and idx.match(PROMPT) == 4 and idx.match(other) == 2
    idx.observe_hit(predicted_blocks=4, cached_blocks=1)  # the backend held fewer: capacity 6 -> 3
    assert idx.capacity_blocks == 3 and len(idx) == 3
    assert idx.match(other) == 2 and idx.match(PROMPT) == 1  # the oldest leaves went, its root stayed
    with pytest.raises(ValueError, match="capacity_blocks"):
        ApproxBlockIndex(0)


def test_approx_index_forgets_the_blocks_of_a_failed_request_only():
    idx = ApproxBlockIndex(capacity_blocks=100)
    idx.on_dispatch(PROMPT[:4])
    other = hash_token_blocks(SYSTEM + [9, 9, 9, 9], BS)  # shares the 4 system blocks, then one of its own
    assert idx.match(other) == 4
    idx.on_dispatch(other)
    idx.forget(other[4:])  # it failed: only the block it added goes
    assert idx.match(PROMPT) == 4 and idx.match(other) == 4 and len(idx) == 4
    idx.forget(other[4:])  # twice: nothing more
    assert len(idx) == 4 and idx.capacity_blocks == 100


def test_approx_backends_route_a_shared_prefix_to_one_backend():
    bs = _backends(2, events=False)
    p = make_policy("kv-aware")
    first = p.on_dispatch(p.choose(PROMPT, bs), PROMPT, 20)
    p.on_complete(first)
    other = hash_token_blocks(SYSTEM + [5, 6, 7, 8], BS)  # same 4-block system prompt, other question
    assert p.choose(other, bs) is first.backend


def test_no_backend_errors_say_why():
    bs = _backends(2)
    for b in bs:
        b.max_outstanding = 1
        b.outstanding_requests = 1
    with pytest.raises(AllBackendsFullError) as e:
        make_policy("least-load").choose([], bs)
    assert e.value.status_code == 429
    bs[0].healthy = bs[1].healthy = False
    with pytest.raises(NoHealthyBackendError) as e:
        make_policy("kv-aware").choose([], bs)
    assert e.value.status_code == 503
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        make_policy("random")
    with pytest.raises(ValueError, match="beta"):
        make_policy("kv-aware", beta=-1)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="min_match"):
            make_policy("kv-aware", min_match=bad)
