"""Speculative verification: greedy prefix rule, exact acceptance cases, and the sampled distribution.

The chi-square tests draw thousands of seeded verifications and check that the first output token
(and the second, given the first draft was accepted) follows the target distribution p, not the
draft's q, with one-hot and random q, and with temperature / top-k / top-p active. Fixed seeds make
them deterministic; the thresholds are the chi-square 99.9 % quantiles.
"""

from __future__ import annotations

import pytest
import torch

from tandem.sample.sampler import SamplingState, filtered_probs
from tandem.sampling_params import SamplingParams
from tandem.spec_decode.rejection import VerifyRow, rejection_sample, verify_batch

V = 6
CHI2_999 = {2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}  # chi-square 0.999 quantiles by degrees of freedom


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread avoids thread-pool wake-ups on a loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic over the support of ``probs`` (tokens with p = 0 must never appear)."""
    support = probs > 0
    assert counts[~support].sum() == 0, f"sampled a token outside the target's support: {counts}"
    expected = probs[support] * counts.sum()
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1


def onehot_rows(ids: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), V).float()


def test_greedy_accepts_longest_matching_prefix_plus_one() -> None:
    target = onehot_rows([3, 1, 4, 1])  # argmax per position
    assert rejection_sample([3, 1, 4], target, None, greedy=True) == [3, 1, 4, 1]  # all + bonus
    assert rejection_sample([3, 1, 5], target, None, greedy=True) == [3, 1, 4]
    assert rejection_sample([0, 1, 4], target, None, greedy=True) == [3]
    assert rejection_sample([], target[:1], None, greedy=True) == [3]


def test_sampled_exact_cases() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, V, generator=g), dim=-1)
    # q == p: acceptance probability min(1, p/q) = 1 at every position, so all drafts + a bonus.
    for _ in range(50):
        out = rejection_sample([2, 5], p, p[:2].clone(), greedy=False, generator=g)
        assert out[:2] == [2, 5] and len(out) == 3
    # p puts no mass on the draft: it is always rejected and replaced by a token from p.
    p0 = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0, 0.0], [1.0 / V] * V])
    for _ in range(50):
        out = rejection_sample([0], p0, None, greedy=False, generator=g)
        assert len(out) == 1 and out[0] in (1, 2)


def test_seeded_rows_are_reproducible() -> None:
    p = torch.softmax(torch.randn(4, V, generator=torch.Generator().manual_seed(1)), dim=-1)
    runs = [[rejection_sample([1, 2, 3], p, None, False, torch.Generator().manual_seed(7)) for _ in range(3)]
            for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("draft_kind", ["onehot", "random"])
def test_first_token_follows_target_distribution(draft_kind: str) -> None:
    g = torch.Generator().manual_seed(123)
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, dim=-1)
    first = torch.zeros(V)
    second_given_accept = torch.zeros(V)
    for _ in range(6000):
        if draft_kind == "onehot":
            drafts, draft_probs = [4, 0], None  # a fixed guess, like an n-gram proposal
        else:
            drafts = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(2)]
            draft_probs = q
        out = rejection_sample(drafts, p, draft_probs, greedy=False, generator=g)
        first[out[0]] += 1
        if out[0] == drafts[0] and len(out) >= 2:
            second_given_accept[out[1]] += 1
    stat, df = chi_square(first, p[0])
    assert stat < CHI2_999[df], (stat, first / first.sum(), p[0])
    stat, df = chi_square(second_given_accept, p[1])
    assert stat < CHI2_999[df], (stat, second_given_accept / second_given_accept.sum(), p[1])


@pytest.mark.parametrize("draft_kind", ["onehot", "random"])
def test_verify_batch_matches_filtered_target(draft_kind: str) -> None:
    """Through ``verify_batch``: temperature 0.8, top-k 4 and top-p 0.8 shape p; the output follows it."""
    g = torch.Generator().manual_seed(5)
    logits = torch.tensor([[2.0, 1.6, 1.2, 0.9, 0.1, -1.0]] * 2)
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.8, seed=3)
    expected = filtered_probs(logits.clone(), [params, params])
    assert int((expected[0] > 0).sum()) == 3  # top-k kept 4 tokens, top-p then 3
    q = torch.softmax(torch.randn(1, V, generator=g), dim=-1)
    state = SamplingState.create(params, [1, 2, 3])
    counts = torch.zeros(V)
    for _ in range(4000):
        if draft_kind == "onehot":
            drafts, draft_probs = [int(logits[0].argmin())], None  # a draft outside the top-k
        else:
            drafts, draft_probs = [int(torch.multinomial(q[0], 1, generator=g))], q
        (result,) = verify_batch(logits, [VerifyRow(state, drafts, draft_probs)])
        counts[result.token_ids[0]] += 1
    stat, df = chi_square(counts, expected[0])
    assert stat < CHI2_999[df], (stat, counts / counts.sum(), expected[0])


def test_verify_batch_penalties_see_accepted_drafts() -> None:
    """Position j's repetition penalty covers drafts [:j]: a draft repeated later is judged penalized."""
    logits = torch.tensor([[0.0, 5.0, 4.0, 0.0, 0.0, 0.0]] * 3)
    greedy = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    state = SamplingState.create(greedy, [0])
    (result,) = verify_batch(logits, [VerifyRow(state, [1, 1])])
    # Position 0: argmax 1 (accepted). Position 1 has seen token 1: 5 / 2 < 4, so argmax 2 != draft 1.
    assert result.token_ids == [1, 2]


def test_verify_batch_logprobs_and_rows() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.05, 0.05]] * 3 + [[0.7, 0.1, 0.1, 0.05, 0.03, 0.02]]))
    a = SamplingState.create(SamplingParams(temperature=0.0, logprobs=1), [0])
    b = SamplingState.create(SamplingParams(temperature=0.0), [0])
    ra, rb = verify_batch(logits, [VerifyRow(a, [1, 3]), VerifyRow(b, [])])
    assert ra.token_ids == [1, 1] and rb.token_ids == [0] and rb.logprobs is None
    assert len(ra.logprobs) == 2
    assert ra.logprobs[0][1].rank == 1
    assert ra.logprobs[0][1].logprob == pytest.approx(torch.log(torch.tensor(0.6)).item())
    with pytest.raises(ValueError):
        verify_batch(logits[:3], [VerifyRow(a, [1, 3]), VerifyRow(b, [])])
