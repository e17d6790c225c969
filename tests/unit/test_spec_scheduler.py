"""Scheduler rules for speculative decoding, model-free: a scripted target and a scripted proposer.

The fake runner verifies drafts greedily against a deterministic "target" (next token = a function of
the history) and proposes the target's true continuation, corrupted at chosen draft positions. Like
``test_scheduler.FakeRunner`` it also plays the KV cache: every computed position writes the prefix
it saw into its slot, and every row checks that its already-computed positions hold its own prefix,
so the rollback of rejected drafts is checked for content, not only for counters.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

from tandem.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tandem.kv_cache.storage import slot_of
from tandem.outputs import ModelRunnerOutput, SchedulerOutput
from tandem.request import Request, RequestStatus
from tandem.sampling_params import SamplingParams
from tandem.scheduler import Scheduler

EOS = 2
_bases = itertools.count(1)


def target_next(history: list[int]) -> int:
    """The scripted target's greedy token after ``history`` (never EOS)."""
    return 100 + (history[-1] * 7 + len(history)) % 37


def make_scheduler(k: int = 3, method: str = "ngram", budget: int = 64, block_size: int = 4,
                   num_blocks: int = 128, max_model_len: int = 512, threshold: int = 0) -> Scheduler:
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k,
                             speculative_model="unused" if method in ("draft", "pard") else None)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16,
                                     long_prefill_token_threshold=threshold),
                     CacheConfig(block_size=block_size), num_blocks, max_model_len, spec)


def make_request(rid: str, prompt_len: int, max_tokens: int, **params) -> Request:
    base = 1000 * next(_bases)
    return Request(rid, list(range(base, base + prompt_len)), SamplingParams(temperature=0.0, **params),
                   eos_token_ids=frozenset({EOS}), max_tokens=max_tokens)


class SpecFakeRunner:
    """Greedy verification against ``target``; drafts = the target's continuation, wrong where ``wrong``
    (request id, draft position) says so."""

    def __init__(self, k: int, target: Callable[[list[int]], int] = target_next,
                 wrong: Callable[[str, int], bool] = lambda rid, pos: False) -> None:
        self.k, self.target, self.wrong = k, target, wrong
        self.history: dict[str, list[int]] = {}
        self.speculative: dict[str, bool] = {}
        self.slots: dict[int, tuple[int, ...]] = {}

    def execute(self, out: SchedulerOutput, block_size: int) -> ModelRunnerOutput:
        for rid in out.finished_request_ids:
            self.history.pop(rid, None)
        for new in out.new_requests:
            self.history[new.request_id] = new.prompt_token_ids + new.output_token_ids
            self.speculative[new.request_id] = new.sampling_params.speculative
        result = ModelRunnerOutput()
        for row in out.scheduled:  # write: real tokens and drafts alike (drafts may be rejected later)
            seq = self.history[row.request_id] + row.spec_token_ids
            end = row.num_computed_tokens + row.num_scheduled_tokens
            assert row.token_ids == seq[row.num_computed_tokens : end], "row tokens are not history + drafts"
            assert not row.num_spec_tokens or end == len(seq), "drafts without the whole history"
            for pos in range(row.num_computed_tokens, end):
                self.slots[slot_of(row.block_ids, pos, block_size)] = tuple(seq[: pos + 1])
        for row in out.scheduled:  # read: everything before the row holds this request's own prefix
            history = self.history[row.request_id]
            for pos in range(row.num_computed_tokens):
                assert self.slots[slot_of(row.block_ids, pos, block_size)] == tuple(history[: pos + 1])
            if row.sample:
                self._verify_and_propose(row, history, result)
        return result

    def _verify_and_propose(self, row, history: list[int], result: ModelRunnerOutput) -> None:
        drafts = row.spec_token_ids
        accepted: list[int] = []
        for draft in drafts:
            if draft != self.target(history + accepted):
                break
            accepted.append(draft)
        tokens = accepted + [self.target(history + accepted)]
        history.extend(tokens)
        result.sampled_token_ids[row.request_id] = tokens
        if self.speculative[row.request_id]:
            proposal, context = [], list(history)
            for pos in range(self.k):
                token = self.target(context)
                proposal.append(token + 1 if self.wrong(row.request_id, pos) else token)
                context.append(proposal[-1])
            result.spec_token_ids[row.request_id] = proposal


def run(sched: Scheduler, runner: SpecFakeRunner, max_steps: int = 1000,
        each_step: Callable[[SchedulerOutput], None] | None = None) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out, sched.block_size))
        sched.check()
        if each_step:
            each_step(out)
        outs.append(out)
    raise AssertionError("requests did not finish")


def plain_output(prompt: list[int], max_tokens: int) -> list[int]:
    history = list(prompt)
    for _ in range(max_tokens):
        history.append(target_next(history))
    return history[len(prompt):]


def test_scripted_acceptance_counts_per_position():
    # Drafts 0 and 1 are always right, draft 2 always wrong: every verification accepts exactly 2.
    sched = make_scheduler(k=3)
    runner = SpecFakeRunner(3, wrong=lambda rid, pos: pos == 2)
    req = make_request("a", 6, max_tokens=16)
    sched.add_request(req)
    outs = run(sched, runner)
    # prefill: 1 token; then 4 steps with 3 drafts (+3 tokens each), then only 2 drafts fit max_tokens.
    assert [r.num_spec_tokens for o in outs for r in o.scheduled] == [0, 3, 3, 3, 3, 2]
    stats = sched.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (5, 14, 10)
    assert stats.num_accepted_tokens_per_pos == [5, 5, 0]
    assert stats.mean_acceptance_length == 3.0
    assert (req.num_draft_tokens, req.num_accepted_tokens) == (14, 10)
    assert req.output_token_ids == plain_output(req.prompt_token_ids, 16)
    assert req.status is RequestStatus.FINISHED_LENGTH


def test_rejected_drafts_roll_back_the_computed_counter():
    sched = make_scheduler(k=4)
    runner = SpecFakeRunner(4, wrong=lambda rid, pos: pos == 1)
    req = make_request("a", 5, max_tokens=30)
    sched.add_request(req)

    def check(out: SchedulerOutput) -> None:
        # Whatever was scheduled, only the accepted part counts as computed: one token is always pending.
        if not req.status.finished:
            assert req.num_computed_tokens == req.num_tokens - 1

    run(sched, runner, each_step=check)
    assert req.output_token_ids == plain_output(req.prompt_token_ids, 30)
    assert sched.spec_stats.num_accepted_tokens_per_pos == [sched.spec_stats.num_drafts, 0, 0, 0]
    assert sched.kv_cache_usage == 0.0


def test_eos_inside_an_accepted_run_ends_the_request_there():
    def target(history: list[int]) -> int:
        return EOS if len(history) == 7 else target_next(history)

    sched = make_scheduler(k=4)
    runner = SpecFakeRunner(4, target=target)
    req = make_request("a", 4, max_tokens=40)
    sched.add_request(req)
    outs = run(sched, runner)
    # The prefill gives position 4; drafts for positions 5..8 are all right, EOS at position 7 among
    # them: 5 tokens come back, the request keeps 3 (ending with EOS) and drops the rest.
    assert len(outs) == 2 and outs[1].scheduled[0].num_spec_tokens == 4
    assert sched.spec_stats.num_accepted_tokens == 4
    assert req.output_token_ids[-1] == EOS and len(req.prompt_token_ids) + req.num_output_tokens == 8
    assert req.status is RequestStatus.FINISHED_STOPPED


def test_min_tokens_and_stop_token_ids_apply_per_accepted_token():
    def target(history: list[int]) -> int:
        return 50 if len(history) in (8, 14) else target_next(history)

    sched = make_scheduler(k=4)
    req = make_request("a", 4, max_tokens=40, stop_token_ids=[50], min_tokens=5)
    sched.add_request(req)
    run(sched, SpecFakeRunner(4, target=target))
    # Output 5 is the stop id but within min_tokens, so it stays; output 11 stops the request.
    assert req.output_token_ids[4] == 50 and req.num_output_tokens == 11
    assert (req.status, req.stop_reason) == (RequestStatus.FINISHED_STOPPED, 50)


def test_budget_and_chunk_cap_trim_drafts():
    sched = make_scheduler(k=4, budget=3)
    runner = SpecFakeRunner(4)
    req = make_request("a", 2, max_tokens=20)
    sched.add_request(req)
    outs = run(sched, runner)
    assert max(o.total_num_scheduled_tokens for o in outs) == 3
    assert {r.num_spec_tokens for o in outs[1:-1] for r in o.scheduled} == {2}
    assert req.output_token_ids == plain_output(req.prompt_token_ids, 20)


def test_draft_models_reserve_lookahead_slots():
    block_size, k = 4, 3
    for method, expect_lookahead in (("draft", True), ("ngram", False)):
        sched = make_scheduler(k=k, method=method, block_size=block_size)
        runner = SpecFakeRunner(k)
        a = make_request("a", 8, max_tokens=20)
        b = make_request("b", 8, max_tokens=20, speculative=False)
        sched.add_request(a)
        sched.add_request(b)

        def check(out: SchedulerOutput, lookahead: int = k if expect_lookahead else 0) -> None:
            for row in out.scheduled:
                end = row.num_computed_tokens + row.num_scheduled_tokens
                needed = end + (lookahead if row.request_id == "a" and row.sample else 0)
                assert len(row.block_ids) >= -(-needed // block_size), row
                if lookahead == 0:
                    assert len(row.block_ids) == -(-end // block_size), row

        run(sched, runner, each_step=check)
        assert a.num_draft_tokens > 0 and b.num_draft_tokens == 0


def test_preemption_drops_drafts_and_outputs_stay_exact():
    sched = make_scheduler(k=3, block_size=4, num_blocks=14, budget=32)
    runner = SpecFakeRunner(3, wrong=lambda rid, pos: pos == 2)
    reqs = [make_request(f"r{i}", 6, max_tokens=24) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    run(sched, runner)
    assert sched.num_preemptions_total > 0
    for r in reqs:
        assert r.output_token_ids == plain_output(r.prompt_token_ids, 24)
        assert r.spec_token_ids == [] or r.status.finished
    assert sched.kv_cache_usage == 0.0


def test_no_block_leaks_after_200_requests_with_random_aborts():
    rng = random.Random(0)
    sched = make_scheduler(k=4, method="draft", block_size=4, num_blocks=64, budget=48)
    runner = SpecFakeRunner(4, wrong=lambda rid, pos: rng.random() < 0.3)
    pending = [make_request(f"r{i}", rng.randint(1, 20), max_tokens=rng.randint(1, 30),
                            speculative=rng.random() < 0.8) for i in range(200)]
    for _ in range(5000):
        while pending and sched.num_waiting < 4:
            sched.add_request(pending.pop())
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out, sched.block_size))
        if rng.random() < 0.2 and sched.requests:
            sched.abort_requests([rng.choice(sorted(sched.requests))])
        sched.check()
    assert not pending and not sched.has_unfinished_requests()
    assert sched.kv_cache_usage == 0.0 and sched.spec_stats.num_drafts > 100
    sched.kv_cache_manager.check()
