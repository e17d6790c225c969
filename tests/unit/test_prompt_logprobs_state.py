"""Prompt logprobs without a model: the per-chunk bookkeeping, and the scheduler's prefix-cache rule."""

from __future__ import annotations

import torch
from test_scheduler import FakeRunner, make_request, make_scheduler, run_to_completion, step

from tandem.sample import prompt_logprobs


def test_chunks_fill_every_position_but_the_first(monkeypatch):
    monkeypatch.setattr(prompt_logprobs, "ROWS_PER_PASS", 3)  # several log-softmax passes per chunk
    prompt = [5, 1, 7, 2, 2, 9, 0, 3]
    logits = torch.randn(len(prompt), 10, generator=torch.Generator().manual_seed(0))
    state = prompt_logprobs.PromptLogprobsState(len(prompt), num_top=2)
    # NOTE: the identity as lm head: "hidden" rows are the logits themselves.
    for start, end in ((0, 5), (5, 8)):  # two prefill chunks; the last position predicts no prompt token
        state.add_chunk(lambda h: h, logits[start:end], prompt, start)
    expected = torch.log_softmax(logits, dim=-1)
    positions = state.take()
    assert positions[0] is None and len(positions) == len(prompt) and state.sent
    for i in range(1, len(prompt)):
        entry = positions[i][prompt[i]]
        assert abs(entry.logprob - expected[i - 1, prompt[i]].item()) < 1e-6
        assert entry.rank == int((expected[i - 1] > expected[i - 1, prompt[i]]).sum()) + 1
        top = sorted(t for t, lp in positions[i].items() if lp.rank <= 2)
        assert top == sorted(expected[i - 1].topk(2).indices.tolist())


def test_a_request_with_prompt_logprobs_skips_the_prefix_cache():
    sched, runner = make_scheduler(budget=64, block_size=4), FakeRunner()
    prompt = list(range(100, 110))
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run_to_completion(sched, runner)
    wants = make_request("b", list(prompt), max_tokens=1, prompt_logprobs=0)
    sched.add_request(wants)
    out, _ = step(sched, runner)
    assert out.scheduled[0].num_computed_tokens == 0 and len(out.scheduled[0].token_ids) == 10
    assert wants.num_cached_tokens == 0
    plain = make_request("c", list(prompt), max_tokens=1)
    sched.add_request(plain)
    out, _ = step(sched, runner)
    assert out.scheduled[0].num_computed_tokens == 8  # the others still hit the blocks "b" wrote too
