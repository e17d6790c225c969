"""Longest prefix match first (scheduler/lpm.py), model-free: the exact admission order on hand-made
queues, cached prompts before long uncached ones within a step's budget, and the starvation bound.
The fake runner of test_scheduler checks every row's KV content, so a wrong hit would fail."""

from __future__ import annotations

import pytest

from tandem.cli import build_parser, engine_config_from_args
from tandem.config import CPU_SERVE_SCHEDULING, CacheConfig, ConfigError, SchedulerConfig
from tandem.scheduler import Scheduler
from tandem.scheduler.lpm import LPM_MAX_QUEUE, lpm_order
from tests.unit.test_scheduler import FakeRunner, counts, make_request, run_to_completion, step

PREFIX = list(range(7000, 7032))  # 8 blocks of 4 tokens


def lpm_scheduler(budget: int = 64, max_seqs: int = 8, max_wait_steps: int = 32, **kw) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, policy="lpm",
                             lpm_max_wait_steps=max_wait_steps, **kw)
    return Scheduler(config, CacheConfig(block_size=4), num_blocks=128, max_model_len=256)


def warm(sched: Scheduler, runner: FakeRunner, prompt: list[int]) -> None:
    """Runs one request of ``prompt`` to the end so its full blocks are in the prefix cache."""
    sched.add_request(make_request("warm", prompt, max_tokens=1))
    run_to_completion(sched, runner)


def test_order_longest_hit_first_ties_fcfs_aged_first_in_fcfs():
    reqs = {rid: make_request(rid, 8) for rid in "abcdef"}
    hits = {"a": 0, "b": 16, "c": 4, "d": 16, "e": 0, "f": 32}
    queued = {"a": 0, "b": 9, "c": 1, "d": 9, "e": 2, "f": 9}
    for rid, r in reqs.items():
        r.queued_step = queued[rid]
    order = lpm_order(reqs.values(), lambda r: hits[r.request_id], step=10, max_wait_steps=9, block_size=4)
    # a, c (waited 10 and 9 steps) are aged: first, in FCFS order; then f, b, d (b before d: FCFS), e
    assert [r.request_id for r in order] == ["a", "c", "f", "b", "d", "e"]
    order = lpm_order(reqs.values(), lambda r: hits[r.request_id], step=10, max_wait_steps=100, block_size=4)
    assert [r.request_id for r in order] == ["f", "b", "d", "c", "a", "e"]


def test_a_queue_longer_than_sglangs_limit_stays_fcfs():
    reqs = [make_request(f"r{i}", 4) for i in range(LPM_MAX_QUEUE + 1)]
    order = lpm_order(reqs, lambda r: int(r.request_id[1:]), step=0, max_wait_steps=32, block_size=4)
    assert order == reqs
    assert lpm_order(reqs[:3], lambda r: int(r.request_id[1:]), step=0, max_wait_steps=32, block_size=4) == reqs[2::-1]


def test_equal_hits_the_prefix_most_waiting_requests_share_first():
    # block hashes by hand: x1 and y1 open two prefixes; y is shared by three requests, x by two
    reqs = {rid: make_request(rid, 8) for rid in "abcdefg"}
    blocks = {"a": [11, 12], "b": [21, 22], "c": [11, 13], "d": [21, 23], "e": [31], "f": [21, 24],
              "g": [41, 42]}
    for rid, r in reqs.items():
        r.block_hashes = blocks[rid]
    hits = {"g": 4}  # g's first block is cached: its next block (42) is its own
    order = lpm_order(reqs.values(), lambda r: hits.get(r.request_id, 0), step=0, max_wait_steps=32,
                      block_size=4)
    assert [r.request_id for r in order] == ["g", "b", "d", "f", "a", "c", "e"]


@pytest.mark.parametrize("policy, expected", [
    ("fcfs", [{"cold": 16}, {"cold": 16}, {"cold": 8, "hit": 3}, {"cold": 1, "hit": 1}, {"hit": 1}]),
    ("lpm", [{"hit": 3, "cold": 13}, {"hit": 1, "cold": 15}, {"hit": 1, "cold": 12}, {"cold": 1}]),
])
def test_a_cached_prompt_goes_before_a_long_uncached_one_within_the_budget(policy, expected):
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16, policy=policy), CacheConfig(block_size=4),
                      num_blocks=128, max_model_len=256)
    runner = FakeRunner()
    warm(sched, runner, PREFIX + [1])
    cold, hit = make_request("cold", 40, max_tokens=2), make_request("hit", PREFIX + [2, 3, 4], max_tokens=3)
    sched.add_request(cold)  # arrives first
    sched.add_request(hit)
    outs = run_to_completion(sched, runner)
    assert [counts(o) for o in outs] == expected
    assert hit.num_cached_tokens == 32 and cold.num_cached_tokens == 0


def stream_of_hits(max_wait_steps: int) -> list[str]:
    """One slot; a cold prompt queued first, then a prefix hit arriving every step: the admission order."""
    sched, runner = lpm_scheduler(max_seqs=1, max_wait_steps=max_wait_steps), FakeRunner()
    warm(sched, runner, PREFIX + [1])
    sched.add_request(make_request("cold", 20, max_tokens=1))
    order: list[str] = []
    for i in range(12):
        sched.add_request(make_request(f"hit{i}", PREFIX + [10 + i], max_tokens=1))
        out, _ = step(sched, runner)
        order += [n.request_id for n in out.new_requests]
    run_to_completion(sched, runner)
    return order


def test_a_long_prompt_is_overtaken_for_at_most_max_wait_steps():
    # each step one hit arrives and one request runs (max_num_seqs 1, one step each): the cold prompt,
    # queued one step before hit0, is overtaken by exactly 4 of them
    assert stream_of_hits(max_wait_steps=4) == ["hit0", "hit1", "hit2", "hit3", "cold", "hit4", "hit5",
                                                "hit6", "hit7", "hit8", "hit9", "hit10"]
    # without a bound within the run, the cold prompt waits behind every hit that keeps arriving
    assert "cold" not in stream_of_hits(max_wait_steps=100)


def test_preempted_and_aged_requests_keep_fcfs_among_themselves():
    sched, runner = lpm_scheduler(budget=64, max_wait_steps=1), FakeRunner()
    warm(sched, runner, PREFIX + [1])
    for rid, prompt in (("a", 12), ("b", PREFIX + [5]), ("c", 8)):
        sched.add_request(make_request(rid, prompt, max_tokens=1))
    sched.num_steps += 1  # every queued request has now waited max_wait_steps: FCFS
    out, _ = step(sched, runner)
    assert [n.request_id for n in out.new_requests] == ["a", "b", "c"]


def test_cpu_serve_defaults_flags_and_validation():
    args = build_parser().parse_args(["serve"])
    config = engine_config_from_args(args).scheduler
    assert config == CPU_SERVE_SCHEDULING
    assert (config.policy, config.long_prefill_token_threshold, config.max_long_partial_prefills,
            config.max_num_batched_tokens) == ("lpm", 256, 1, 2048)
    args = build_parser().parse_args(["serve", "--scheduling-policy", "fcfs", "--lpm-max-wait-steps", "5"])
    assert (engine_config_from_args(args).scheduler.policy, args.lpm_max_wait_steps) == ("fcfs", 5)
    assert SchedulerConfig().policy == "fcfs"  # the library keeps vLLM's default
    with pytest.raises(ConfigError, match="lpm_max_wait_steps must be an integer >= 1"):
        SchedulerConfig(policy="lpm", lpm_max_wait_steps=0)
    with pytest.raises(ConfigError, match="policy must be one of"):
        SchedulerConfig(policy="sjf")
