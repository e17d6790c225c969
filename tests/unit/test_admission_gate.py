"""Admission skips (scheduler/admission.py), model-free: a request waits for the prefix another one is
computing, and long prefills run one at a time so prefix hits overtake them. The fake runner of
test_scheduler checks every row's KV content, so a hit on blocks that were not written would fail."""

from __future__ import annotations

import pytest

from tandem.cli import build_parser, engine_config_from_args
from tandem.config import CacheConfig, ConfigError, SchedulerConfig
from tandem.request import RequestStatus
from tandem.scheduler import Scheduler
from tests.unit.test_scheduler import FakeRunner, counts, make_request, make_scheduler, run_to_completion, step

PREFIX = list(range(5000, 5032))  # 8 blocks of 4 tokens


def test_a_request_waits_for_the_prefix_another_is_computing_then_hits_it():
    sched, runner = make_scheduler(budget=64, block_size=4), FakeRunner()
    a, b = make_request("a", PREFIX + [1, 2], max_tokens=2), make_request("b", PREFIX + [3, 4], max_tokens=2)
    other = make_request("c", 10, max_tokens=2)
    for r in (a, b, other):
        sched.add_request(r)
    first, _ = step(sched, runner)
    assert counts(first) == {"a": 34, "c": 10}  # b held back, c (no shared prefix) not
    assert b.status is RequestStatus.WAITING
    second, _ = step(sched, runner)
    assert counts(second) == {"a": 1, "c": 1, "b": 2}  # b: only its own 2 tokens
    run_to_completion(sched, runner)
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 32)
    assert sched.kv_cache_manager.prefix_cache_hits == 32


def test_the_waiting_request_follows_a_chunked_prefill_to_the_end_of_the_shared_prefix():
    sched, runner = make_scheduler(budget=12, block_size=4), FakeRunner()
    a, b = make_request("a", PREFIX + [1, 2], max_tokens=1), make_request("b", PREFIX + [3, 4], max_tokens=1)
    sched.add_request(a)
    sched.add_request(b)
    outs = run_to_completion(sched, runner)
    assert [counts(o) for o in outs] == [{"a": 12}, {"a": 12}, {"a": 10}, {"b": 2}]
    assert b.num_cached_tokens == 32


def test_without_prefix_caching_or_with_prompt_logprobs_nothing_waits():
    sched, runner = make_scheduler(budget=80, block_size=4, caching=False), FakeRunner()
    sched.add_request(make_request("a", PREFIX + [1], max_tokens=1))
    sched.add_request(make_request("b", PREFIX + [2], max_tokens=1))
    assert counts(step(sched, runner)[0]) == {"a": 33, "b": 33}
    sched, runner = make_scheduler(budget=80, block_size=4), FakeRunner()
    sched.add_request(make_request("a", PREFIX + [1], max_tokens=1))
    sched.add_request(make_request("b", PREFIX + [2], max_tokens=1, prompt_logprobs=0))
    assert counts(step(sched, runner)[0]) == {"a": 33, "b": 33}  # b cannot take a hit: no reason to wait


def test_long_prefills_run_one_at_a_time_and_short_requests_overtake_them():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, long_prefill_token_threshold=8,
                                      max_long_partial_prefills=1),
                      CacheConfig(block_size=4), num_blocks=64, max_model_len=256)
    runner = FakeRunner()
    for rid, n in (("long1", 20), ("long2", 20), ("short", 6)):
        sched.add_request(make_request(rid, n, max_tokens=2))
    outs = run_to_completion(sched, runner)
    assert [counts(o) for o in outs] == [
        {"long1": 8, "short": 6},  # long2 waits; the short prompt samples in the first step
        {"long1": 8, "short": 1},
        {"long1": 4, "long2": 8},  # long1's last chunk (4 <= 8 left): the next long one starts
        {"long1": 1, "long2": 8},
        {"long2": 4},
        {"long2": 1},
    ]


def test_without_the_limit_long_prefills_share_a_step():
    sched, runner = make_scheduler(budget=64, block_size=4, threshold=8), FakeRunner()
    for rid, n in (("long1", 20), ("long2", 20), ("short", 6)):
        sched.add_request(make_request(rid, n, max_tokens=2))
    assert counts(step(sched, runner)[0]) == {"long1": 8, "long2": 8, "short": 6}


def test_max_long_partial_prefills_flag_and_validation():
    args = build_parser().parse_args(["serve", "--long-prefill-token-threshold", "256",
                                      "--max-long-partial-prefills", "1"])
    config = engine_config_from_args(args).scheduler
    assert (config.long_prefill_token_threshold, config.max_long_partial_prefills) == (256, 1)
    with pytest.raises(ConfigError, match="max_long_partial_prefills must be >= 0"):
        SchedulerConfig(max_long_partial_prefills=-1)
