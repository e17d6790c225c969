"""Scheduler rules, model-free: a fake runner returns a fixed token per sampling row (vLLM v1 style).

The fake runner also plays the KV cache: every computed position writes "the prefix it has seen" into
its slot, and every row checks that the slots of its already-computed positions hold exactly its own
prefix. So block tables, prefix hits and preemption-with-recompute are checked for content, not only
for counts.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest

from tandem.config import CacheConfig, SchedulerConfig
from tandem.kv_cache.storage import slot_of
from tandem.outputs import EngineCoreOutput, Logprob, ModelRunnerOutput, SchedulerOutput
from tandem.request import Request, RequestStatus
from tandem.sampling_params import SamplingParams
from tandem.scheduler import Scheduler

EOS = 2
_prompt_base = itertools.count(1)


def make_scheduler(
    budget: int = 32, max_seqs: int = 8, block_size: int = 4, num_blocks: int = 64,
    max_model_len: int = 256, caching: bool = True, threshold: int = 0,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                        long_prefill_token_threshold=threshold),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_blocks=num_blocks, max_model_len=max_model_len,
    )


def make_request(rid: str, prompt: int | list[int], max_tokens: int = 4, **params) -> Request:
    """An int ``prompt`` makes that many tokens sharing no prefix with any other request."""
    if isinstance(prompt, int):
        base = 1000 * next(_prompt_base)
        tokens = list(range(base, base + prompt))
    else:
        tokens = prompt
    params = SamplingParams(**params)
    return Request(rid, tokens, params, eos_token_ids=frozenset({EOS}), max_tokens=max_tokens)


class FakeRunner:
    """Keeps per-request token history from ``new_requests`` + its own samples, like the real runner."""

    def __init__(self, sampler: Callable[[str, int], int] | None = None) -> None:
        self.sampler = sampler or (lambda rid, i: 7)
        self.history: dict[str, list[int]] = {}
        self.slots: dict[int, tuple[int, ...]] = {}  # slot -> the token prefix whose last KV it holds

    def execute(self, out: SchedulerOutput, block_size: int) -> ModelRunnerOutput:
        for rid in out.finished_request_ids:
            self.history.pop(rid, None)
        for new in out.new_requests:
            assert new.request_id not in self.history, "new_requests repeated a request"
            self.history[new.request_id] = new.prompt_token_ids + new.output_token_ids
        for row in out.scheduled:  # write this step's KV first (as a per-layer runner does)
            tokens = self.history[row.request_id]
            start = row.num_computed_tokens
            assert row.token_ids == tokens[start : start + len(row.token_ids)]
            for pos in range(start, start + len(row.token_ids)):
                self.slots[slot_of(row.block_ids, pos, block_size)] = tuple(tokens[: pos + 1])
        for row in out.scheduled:  # then read: every earlier position must hold this request's prefix
            tokens = self.history[row.request_id]
            for pos in range(row.num_computed_tokens):
                assert self.slots[slot_of(row.block_ids, pos, block_size)] == tuple(tokens[: pos + 1])
        sampled = {}
        for row in out.scheduled:
            if row.sample:
                history = self.history[row.request_id]
                sampled[row.request_id] = [self.sampler(row.request_id, len(history))]
                history.extend(sampled[row.request_id])
        return ModelRunnerOutput(sampled_token_ids=sampled)


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    out = sched.schedule()
    result = runner.execute(out, sched.block_size)
    outputs = sched.update_from_output(out, result)
    sched.check()
    return out, outputs


def run_to_completion(sched: Scheduler, runner: FakeRunner, max_steps: int = 2000) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs
        out, _ = step(sched, runner)
        assert sched.config.max_num_batched_tokens >= out.total_num_scheduled_tokens
        assert len(out.scheduled) <= sched.config.max_num_seqs
        outs.append(out)
    raise AssertionError("requests did not finish")


def counts(out: SchedulerOutput) -> dict[str, int]:
    return {r.request_id: r.num_scheduled_tokens for r in out.scheduled}


# ---- budget, chunking, admission ----


def test_long_prompt_is_chunked_by_budget():
    sched, runner = make_scheduler(budget=32), FakeRunner()
    req = make_request("a", 100, max_tokens=3)
    sched.add_request(req)
    outs = run_to_completion(sched, runner)
    assert [counts(o) for o in outs] == [{"a": 32}, {"a": 32}, {"a": 32}, {"a": 4}, {"a": 1}, {"a": 1}]
    assert [o.scheduled[0].num_computed_tokens for o in outs] == [0, 32, 64, 96, 100, 101]
    assert [o.scheduled[0].sample for o in outs] == [False, False, False, True, True, True]
    assert req.output_token_ids == [7, 7, 7]
    assert req.status is RequestStatus.FINISHED_LENGTH


def test_decodes_ride_along_with_chunked_prefill():
    sched, runner = make_scheduler(budget=40, threshold=32), FakeRunner()
    sched.add_request(make_request("short", 4, max_tokens=10))
    sched.add_request(make_request("long", 100, max_tokens=2))
    outs = [step(sched, runner)[0] for _ in range(5)]
    assert [counts(o) for o in outs] == [
        {"short": 4, "long": 32},
        {"short": 1, "long": 32},
        {"short": 1, "long": 32},
        {"short": 1, "long": 4},
        {"short": 1, "long": 1},
    ]
    assert [r.sample for r in outs[3].scheduled] == [True, True]


def test_budget_caps_admission_and_next_request_gets_the_rest():
    sched, runner = make_scheduler(budget=32), FakeRunner()
    for rid in ("a", "b", "c"):
        sched.add_request(make_request(rid, 20, max_tokens=2))
    out, _ = step(sched, runner)
    assert counts(out) == {"a": 20, "b": 12}  # c waits: no budget left
    assert sched.num_running == 2 and sched.num_waiting == 1
    out, _ = step(sched, runner)
    assert counts(out) == {"a": 1, "b": 8, "c": 20}


def test_max_num_seqs_and_fcfs_order():
    sched, runner = make_scheduler(budget=100, max_seqs=2), FakeRunner()
    for rid in ("a", "b", "c", "d"):
        sched.add_request(make_request(rid, 5, max_tokens=2 if rid == "a" else 3))
    admitted: list[str] = []
    for out in run_to_completion(sched, runner):
        assert len(out.scheduled) <= 2
        admitted += [n.request_id for n in out.new_requests]
    assert admitted == ["a", "b", "c", "d"]


def test_head_of_queue_is_not_overtaken():
    sched, runner = make_scheduler(budget=64, block_size=4, num_blocks=8), FakeRunner()
    sched.add_request(make_request("a", 20, max_tokens=3))  # 5 blocks, grows to 6
    sched.add_request(make_request("big", 13, max_tokens=2))  # 4 blocks: does not fit beside a
    sched.add_request(make_request("small", 2, max_tokens=2))  # 1 block: would fit, must wait
    out, _ = step(sched, runner)
    assert counts(out) == {"a": 20}
    out, _ = step(sched, runner)
    assert counts(out) == {"a": 1}
    assert [r.request_id for r in sched.waiting] == ["big", "small"]
    outs = run_to_completion(sched, runner)
    admitting = [o for o in outs if o.new_requests]
    assert [[n.request_id for n in o.new_requests] for o in admitting] == [["big", "small"]]
    assert "a" in admitting[0].finished_request_ids  # admitted once a finished and freed its blocks


def test_prefix_hit_skips_cached_blocks_and_counts_tokens():
    sched, runner = make_scheduler(budget=64, block_size=4), FakeRunner()
    prompt = list(range(100, 110))
    first = make_request("a", prompt, max_tokens=1)
    sched.add_request(first)
    run_to_completion(sched, runner)
    second = make_request("b", list(prompt), max_tokens=1)
    sched.add_request(second)
    out, outputs = step(sched, runner)
    assert out.scheduled[0].num_computed_tokens == 8  # two full blocks reused, last token recomputed
    assert out.scheduled[0].token_ids == [108, 109]
    assert second.num_cached_tokens == 8 and first.num_cached_tokens == 0
    assert outputs[0].num_cached_tokens == 8 and outputs[0].num_prompt_tokens == 10
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)


# ---- preemption ----


def test_preemption_recomputes_newest_and_everything_finishes():
    sched = make_scheduler(budget=64, block_size=4, num_blocks=10, caching=False)
    runner = FakeRunner(sampler=lambda rid, i: 10 + i)
    reqs = [make_request(f"r{i}", 8, max_tokens=12) for i in range(3)]  # each grows to 5 blocks
    for req in reqs:
        sched.add_request(req)
    outs = run_to_completion(sched, runner)
    preempting = [o for o in outs if o.num_preempted]
    assert preempting, "the pool of 10 blocks must run out for 3 requests of up to 5 blocks"
    first = preempting[0]
    assert "r2" not in counts(first) and sched.num_preemptions_total >= 1
    resumed = next(o for o in outs[outs.index(first) + 1 :] if "r2" in counts(o))
    row = resumed.scheduled[[r.request_id for r in resumed.scheduled].index("r2")]
    assert row.num_computed_tokens == 0
    assert len(row.token_ids) > 8  # the prompt and the output tokens generated before preemption
    assert row.token_ids[:8] == reqs[2].prompt_token_ids
    assert row.token_ids[8:] == list(range(18, 10 + len(row.token_ids)))
    assert "r2" not in [n.request_id for n in resumed.new_requests]  # the runner kept its state
    for req in reqs:
        assert req.status is RequestStatus.FINISHED_LENGTH
        assert req.output_token_ids == list(range(18, 30))  # recompute did not change the tokens
        assert req.num_computed_tokens == 19
    assert reqs[2].num_preemptions >= 1 and reqs[0].num_preemptions == 0
    assert sum(r.num_preemptions for r in reqs) == sched.num_preemptions_total
    assert sched.kv_cache_manager.num_free_blocks == 10
    sched.check()


def test_preempted_request_goes_to_front_and_nothing_is_admitted_that_step():
    sched = make_scheduler(budget=64, max_seqs=2, block_size=4, num_blocks=6, caching=False, threshold=4)
    runner = FakeRunner()
    a, b, c = (make_request(rid, 12, max_tokens=6) for rid in "abc")
    for req in (a, b, c):
        sched.add_request(req)
    outs = [step(sched, runner)[0] for _ in range(3)]  # a and b prefill in chunks of 4: 6 blocks used
    assert [counts(o) for o in outs] == [{"a": 4, "b": 4}] * 3
    assert sched.kv_cache_manager.num_free_blocks == 0
    out, _ = step(sched, runner)  # a's decode needs a 4th block: b (newest) is preempted
    assert (counts(out), out.num_preempted) == ({"a": 1}, 1)
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.output_token_ids == [7]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]  # b goes back to the front
    # NOTE: b's first chunk (1 block) would fit now, but a preempting step admits no one.
    assert sched.kv_cache_manager.num_free_blocks == 2
    out, _ = step(sched, runner)
    assert counts(out) == {"a": 1, "b": 4}
    assert out.scheduled[1].num_computed_tokens == 0 and out.new_requests == []
    run_to_completion(sched, runner)
    assert [r.output_token_ids for r in (a, b, c)] == [[7] * 6] * 3
    assert sched.kv_cache_manager.num_free_blocks == 6


def test_preemption_with_prefix_cache_reuses_own_blocks():
    sched = make_scheduler(budget=64, block_size=4, num_blocks=9, caching=True)
    runner = FakeRunner(sampler=lambda rid, i: 10 + i + (100 if rid == "r1" else 0))
    reqs = [make_request(f"r{i}", [i + 20] * 8, max_tokens=12) for i in range(2)]
    for req in reqs:
        sched.add_request(req)
    outs = run_to_completion(sched, runner)
    # both grow to 5 blocks (19 KV positions) in a pool of 9: at position 16 r1 (newest) preempts itself
    assert [o.num_preempted for o in outs].count(1) == 1 and sched.num_preemptions_total == 1
    preempted_at = next(i for i, o in enumerate(outs) if o.num_preempted)
    assert counts(outs[preempted_at]) == {"r0": 1}
    assert outs[preempted_at - 1].scheduled[1].num_computed_tokens == 15
    resumed = next(r for o in outs[preempted_at:] for r in o.scheduled if r.request_id == "r1")
    # r1's four full blocks (prompt + 8 output tokens) were still cached: only the last token is recomputed
    assert resumed.num_computed_tokens == 16 and resumed.token_ids == [126]
    assert resumed.block_ids[:4] == outs[preempted_at - 1].scheduled[1].block_ids
    assert reqs[1].output_token_ids == list(range(118, 130))
    assert reqs[1].num_cached_tokens == 0  # counts the first admission only
    assert (sched.make_stats().prefix_cache_queries, sched.make_stats().prefix_cache_hits) == (8 + 8 + 17, 16)
    assert sched.kv_cache_manager.num_free_blocks == 9


def test_single_request_larger_than_pool_stops_at_pool_size():
    sched, runner = make_scheduler(block_size=4, num_blocks=4, max_model_len=100), FakeRunner()
    assert sched.max_model_len == 16
    req = make_request("a", 10, max_tokens=50)
    sched.add_request(req)
    run_to_completion(sched, runner)
    assert req.status is RequestStatus.FINISHED_LENGTH and req.num_tokens == 16
    assert sched.num_preemptions_total == 0


# ---- stop conditions ----


def finish(
    req: Request, sampler: Callable[[str, int], int], max_model_len: int = 256
) -> list[EngineCoreOutput]:
    sched, runner = make_scheduler(max_model_len=max_model_len), FakeRunner(sampler)
    sched.add_request(req)
    outputs: list[EngineCoreOutput] = []
    while sched.has_unfinished_requests():
        outputs += step(sched, runner)[1]
    assert sched.kv_cache_manager.num_free_blocks == 64
    return outputs


def tokens_then(seq: list[int]) -> Callable[[str, int], int]:
    return lambda rid, i: seq[i - 5] if i - 5 < len(seq) else 7


def test_eos_stops_with_no_stop_reason():
    req = make_request("a", 5, max_tokens=10)
    outputs = finish(req, tokens_then([3, 4, EOS, 5]))
    assert req.output_token_ids == [3, 4, EOS]  # EOS stays in the token ids
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", None)
    assert [o.new_token_ids for o in outputs] == [[3], [4], [EOS]]
    assert req.status is RequestStatus.FINISHED_STOPPED


def test_ignore_eos_runs_to_max_tokens():
    req = make_request("a", 5, max_tokens=4, ignore_eos=True)
    outputs = finish(req, tokens_then([EOS, EOS, EOS, EOS, EOS]))
    assert req.output_token_ids == [EOS] * 4
    assert outputs[-1].finish_reason == "length"


def test_stop_token_ids_set_stop_reason():
    req = make_request("a", 5, max_tokens=10, stop_token_ids=[9], ignore_eos=True)
    outputs = finish(req, tokens_then([3, 9, 4]))
    assert req.output_token_ids == [3, 9]
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", 9)
    assert req.stop_reason == 9


def test_eos_in_stop_token_ids_has_no_stop_reason():
    """As vLLM's check_stop: EOS is checked first, so listing it in stop_token_ids changes nothing;
    with ignore_eos it is a stop token like any other."""
    req = make_request("a", 5, max_tokens=10, stop_token_ids=[EOS])
    outputs = finish(req, tokens_then([3, EOS, 4]))
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", None)
    req = make_request("b", 5, max_tokens=10, stop_token_ids=[EOS], ignore_eos=True)
    outputs = finish(req, tokens_then([3, EOS, 4]))
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", EOS)


def test_stop_token_id_as_the_last_allowed_token_is_stop():
    """vLLM's check_stop looks at stop tokens before max_tokens: "stop" with the id, not "length"."""
    req = make_request("a", 5, max_tokens=2, stop_token_ids=[9])
    outputs = finish(req, tokens_then([3, 9]))
    assert req.output_token_ids == [3, 9]
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", 9)


def test_min_tokens_delays_eos_and_stop_tokens():
    req = make_request("a", 5, max_tokens=10, min_tokens=2, stop_token_ids=[9])
    outputs = finish(req, tokens_then([EOS, 9, 9, 4]))
    assert req.output_token_ids == [EOS, 9, 9]  # tokens 1 and 2 are within min_tokens
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", 9)


def test_max_tokens_gives_length():
    req = make_request("a", 5, max_tokens=3)
    outputs = finish(req, tokens_then([]))
    assert req.output_token_ids == [7, 7, 7]
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("length", None)


def test_stop_token_on_last_allowed_token_is_stop():
    req = make_request("a", 5, max_tokens=2)
    outputs = finish(req, tokens_then([3, EOS]))
    assert outputs[-1].finish_reason == "stop"


def test_max_model_len_gives_length():
    req = make_request("a", 5, max_tokens=100)
    outputs = finish(req, tokens_then([]), max_model_len=8)
    assert req.num_tokens == 8 and req.output_token_ids == [7, 7, 7]
    assert outputs[-1].finish_reason == "length"


def test_logprobs_are_passed_through():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=1))
    out = sched.schedule()
    lp = {7: Logprob(-0.5, 1)}
    outputs = sched.update_from_output(out, ModelRunnerOutput({"a": [7]}, {"a": [lp]}))
    assert outputs[0].new_logprobs == [lp]
    assert outputs[0].finish_reason == "length"
    assert sched.schedule().finished_request_ids == {"a"}


# ---- abort, errors ----


def test_abort_frees_blocks_at_once_waiting_and_running():
    sched, runner = make_scheduler(budget=16, block_size=4, num_blocks=16), FakeRunner()
    sched.add_request(make_request("run", 12, max_tokens=5))
    sched.add_request(make_request("wait", 12, max_tokens=5))
    out, _ = step(sched, runner)
    assert counts(out) == {"run": 12, "wait": 4}
    sched.add_request(make_request("queued", 4, max_tokens=5))
    assert sched.kv_cache_manager.num_free_blocks == 16 - 3 - 1
    sched.abort_requests(["run", "queued", "unknown"])
    assert sched.kv_cache_manager.num_free_blocks == 16 - 1
    assert sched.num_running == 1 and sched.num_waiting == 0
    sched.check()
    sched.abort_requests(["wait"])
    assert sched.kv_cache_manager.num_free_blocks == 16
    assert not sched.has_unfinished_requests()
    out = sched.schedule()
    assert out.finished_request_ids == {"run", "queued", "wait"} and out.is_empty
    assert sched.schedule().finished_request_ids == set()


def test_abort_between_schedule_and_update_is_skipped():
    sched = make_scheduler()
    req = make_request("a", 5)
    sched.add_request(req)
    out = sched.schedule()
    sched.abort_requests(["a"])
    assert sched.update_from_output(out, ModelRunnerOutput({"a": [7]})) == []
    assert req.status is RequestStatus.FINISHED_ABORTED and req.output_token_ids == []
    sched.check()


def test_requests_that_can_never_fit_raise():
    sched = make_scheduler(block_size=4, num_blocks=4, max_model_len=100)
    with pytest.raises(ValueError, match="needs 5 KV blocks but the whole pool has 4"):
        sched.add_request(make_request("a", 17))
    sched = make_scheduler(max_model_len=10)
    with pytest.raises(ValueError, match="exceeds max_model_len 10"):
        sched.add_request(make_request("b", 11))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request(make_request("c", []))
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        sched.add_request(make_request("d", 3, max_tokens=0))
    sched.add_request(make_request("e", 3))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_request("e", 3))
    assert sched.num_waiting == 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_soak_keeps_invariants_and_leaks_nothing(seed):
    """Random arrivals (sharing prefixes), aborts and EOS under a tight pool; the runner checks KV content."""
    rng = random.Random(seed)
    sched = make_scheduler(budget=24, max_seqs=4, block_size=4, num_blocks=12, max_model_len=40, threshold=8)
    runner = FakeRunner(sampler=lambda rid, i: rng.choice([EOS, 3, 4, 5, 6, 7, 8, 9, 10, 11]))
    prefixes = [[rng.randrange(20, 60) for _ in range(20)] for _ in range(3)]
    reqs: list[Request] = []
    for i in range(400):
        if rng.random() < 0.3 and len(reqs) < 60:
            prompt = rng.choice(prefixes)[: rng.randrange(1, 21)] + [rng.randrange(60, 90)] * rng.randrange(4)
            reqs.append(make_request(f"q{i}", prompt, max_tokens=rng.randrange(1, 16), min_tokens=1))
            sched.add_request(reqs[-1])
        if rng.random() < 0.05 and reqs:
            sched.abort_requests([rng.choice(reqs).request_id])
        step(sched, runner)
    run_to_completion(sched, runner)
    assert all(r.status.finished for r in reqs)
    for r in reqs:
        if r.status is not RequestStatus.FINISHED_ABORTED:
            assert 2 <= r.num_output_tokens <= r.max_tokens or r.num_output_tokens == r.max_tokens == 1
            assert r.num_tokens <= 40
    assert sched.kv_cache_manager.num_free_blocks == 12
    stats = sched.make_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
