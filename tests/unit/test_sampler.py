"""Sampler: greedy/random equivalences, filters, seeds, penalties, min_tokens, logprobs, distributions."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.sample import Sampler, SamplingState, ops
from tandem.sampling_params import SamplingParams

V = 64


def _state(prompt=(0,), output=(), eos=(), **params) -> SamplingState:
    return SamplingState.create(SamplingParams(**params), list(prompt), list(output), frozenset(eos))


def _distinct_logits(rows: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    """Logits whose values are a permutation of 0, 0.5, 1, ... per row (top gap 0.5)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(vocab, generator=g).float() * 0.5 for _ in range(rows)])


def test_greedy_is_argmax():
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(1))
    out = Sampler()(logits, [_state(temperature=0.0) for _ in range(8)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8


def test_greedy_does_not_modify_caller_logits():
    logits = _distinct_logits(2)
    before = logits.clone()
    Sampler()(logits, [_state(temperature=0.5, repetition_penalty=2.0, output=[1, 2], top_p=0.5)] * 2)
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "params",
    [dict(temperature=1e-3), dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0), dict(top_k=1, top_p=0.5)],
)
def test_degenerate_random_settings_equal_greedy(params):
    torch.manual_seed(0)
    logits = _distinct_logits(32, seed=3)
    greedy = logits.argmax(dim=-1).tolist()
    for _ in range(5):
        assert Sampler()(logits, [_state(**params) for _ in range(32)]).token_ids == greedy


def test_min_p_samples_only_tokens_above_threshold():
    probs = torch.tensor([0.30, 0.20, 0.14, 0.10, 0.09, 0.08, 0.05, 0.04])
    logits = probs.log().expand(4000, -1)
    # threshold 0.3 * 0.30 = 0.09: tokens 0..4 allowed (0.09 >= 0.09), 5..7 never.
    states = [_state(min_p=0.3, seed=i) for i in range(4000)]
    sampled = Sampler()(logits, states).token_ids
    assert set(sampled) == {0, 1, 2, 3, 4}


def _run_steps(sampler, rows_logits, states, steps):
    """Sample ``steps`` times; ``rows_logits(step)`` gives ``[len(states), V]``; returns tokens per row."""
    tokens = [[] for _ in states]
    for step in range(steps):
        out = sampler(rows_logits(step), states)
        for row, (state, token) in enumerate(zip(states, out.token_ids, strict=True)):
            state.output_token_ids.append(token)
            tokens[row].append(token)
    return tokens


def _step_logits(seed: int, step: int, vocab: int = 1000) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed * 1000 + step))


def test_seeded_request_is_batch_and_row_invariant():
    params = dict(temperature=0.9, top_p=0.95, top_k=200, repetition_penalty=1.1, seed=1234)
    alone = _run_steps(Sampler(), lambda s: _step_logits(7, s)[None], [_state(**params)], 20)[0]

    others = [dict(temperature=1.0), dict(temperature=0.7, seed=99), dict(temperature=0.0),
              dict(temperature=1.2, top_p=0.5)]
    for row in (0, 2, 4):
        torch.manual_seed(row)  # a different global stream each time: must not matter
        seeds = [11, 12, 13, 14]
        param_rows = others[:row] + [params] + others[row:]
        seed_rows = seeds[:row] + [7] + seeds[row:]
        states = [_state(**p) for p in param_rows]
        tokens = _run_steps(
            Sampler(), lambda s, seed_rows=seed_rows: torch.stack([_step_logits(x, s) for x in seed_rows]),
            states, 20,
        )
        assert tokens[row] == alone
    assert len(set(alone)) > 5  # really random, not a constant


def test_unseeded_requests_differ_between_runs():
    logits = torch.zeros(1, 1000)
    runs = {tuple(_run_steps(Sampler(), lambda s: logits, [_state()], 10)[0]) for _ in range(3)}
    assert len(runs) > 1


def test_repetition_penalty_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -4.0]])
    ops.apply_repetition_penalty(logits, torch.tensor([0, 1, 4]), torch.tensor([2.0]))
    assert logits.tolist() == [[1.0, -2.0, 0.5, 3.0, -8.0]]


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 50, generator=g) * 3
    prompts = [[1, 2, 3], [4, 4, 9], [0]]
    outputs = [[3, 7, 7], [], [49, 1]]
    ours = logits.clone()
    seen, _ = ops.flat_token_counts([torch.tensor(p + o) for p, o in zip(prompts, outputs, strict=True)], 50)
    ops.apply_repetition_penalty(ours, seen, torch.tensor([1.3, 1.3, 1.3]))
    processor = RepetitionPenaltyLogitsProcessor(penalty=1.3)
    for row in range(3):
        ids = torch.tensor([prompts[row] + outputs[row]])
        expected = processor(ids, logits[row : row + 1].clone())
        torch.testing.assert_close(ours[row : row + 1], expected, rtol=0, atol=0)


def test_presence_frequency_penalties_hand_computed():
    logits = torch.zeros(2, 6)
    index, counts = ops.flat_token_counts([torch.tensor([], dtype=torch.int64), torch.tensor([3, 3, 5])], 6)
    ops.apply_presence_frequency_penalties(logits, index, counts, torch.tensor([9.0, 0.5]),
                                           torch.tensor([9.0, 0.25]))
    assert logits.tolist() == [[0.0] * 6, [0.0, 0.0, 0.0, -(2 * 0.25 + 0.5), 0.0, -(0.25 + 0.5)]]


def test_flat_token_counts():
    index, counts = ops.flat_token_counts([torch.tensor([4, 1, 4]), torch.tensor([], dtype=torch.int64),
                                           torch.tensor([0, 9, 9, 9])], 10)
    assert index.tolist() == [1, 4, 20, 29] and counts.tolist() == [1, 2, 1, 3]


def test_penalties_through_sampler_change_greedy_choice():
    logits = torch.tensor([[0.0, 5.0, 4.8, 4.0, 1.0, 0.0]])
    assert Sampler()(logits, [_state(temperature=0)]).token_ids == [1]
    # prompt token 1 is penalized by repetition (5/1.1=4.545 < 4.8) but not by presence/frequency.
    assert Sampler()(logits, [_state(prompt=[1], temperature=0, repetition_penalty=1.1)]).token_ids == [2]
    assert Sampler()(logits, [_state(prompt=[1], temperature=0, presence_penalty=2.0)]).token_ids == [1]
    state = _state(output=[1, 1, 2], temperature=0, presence_penalty=0.1, frequency_penalty=0.5)
    # token1: 5 - 0.1 - 1.0 = 3.9; token2: 4.8 - 0.1 - 0.5 = 4.2; token3: 4.0 -> argmax 2.
    assert Sampler()(logits, [state]).token_ids == [2]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 1.0, 9.0, 2.0, 0.0, 0.0, 0.0, 8.0]])  # EOS=2, stop id 7 lead
    params = dict(temperature=0, min_tokens=3, stop_token_ids=[7])
    assert Sampler()(logits, [_state(output=[1, 1], eos=[2], **params)]).token_ids == [3]
    assert Sampler()(logits, [_state(output=[1, 1, 1], eos=[2], **params)]).token_ids == [2]
    # ignore_eos: EOS is not a stop token, so min_tokens only masks stop_token_ids.
    ignore = _state(output=[], eos=[2], ignore_eos=True, **params)
    assert Sampler()(logits, [ignore]).token_ids == [2]


def test_logprobs_are_raw_log_softmax_with_ranks():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 100, generator=g) * 2
    states = [_state(logprobs=3, temperature=0.0), _state(temperature=0.0),
              _state(logprobs=0, temperature=0.5, repetition_penalty=1.5, output=[5])]
    out = Sampler()(logits, states)
    expected = torch.log_softmax(logits, dim=-1)
    order = expected.argsort(dim=-1, descending=True)
    assert out.logprobs[1] is None
    first = out.logprobs[0]
    assert list(first) == order[0, :3].tolist()  # sampled (greedy = rank 1) then the top 3
    for token, lp in first.items():
        assert lp.logprob == pytest.approx(expected[0, token].item(), abs=1e-6)
        assert lp.rank == order[0].tolist().index(token) + 1
    third = out.logprobs[2]
    (token,) = third
    assert token == out.token_ids[2]
    assert third[token].logprob == pytest.approx(expected[2, token].item(), abs=1e-6)
    assert third[token].rank == order[2].tolist().index(token) + 1


def test_logprobs_of_sampled_token_outside_top_n():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])
    # min_tokens hides tokens 0 and 1 (EOS + stop id), so greedy samples token 2 (rank 3).
    state = _state(eos=[0], temperature=0, min_tokens=1, stop_token_ids=[1], logprobs=1)
    out = Sampler()(logits, [state])
    assert out.token_ids == [2]
    position = out.logprobs[0]
    assert list(position) == [2, 0]
    expected = torch.log_softmax(logits[0], dim=-1)
    assert position[2].rank == 3 and position[0].rank == 1
    assert position[2].logprob == pytest.approx(expected[2].item(), abs=1e-6)
    assert position[0].logprob == pytest.approx(expected[0].item(), abs=1e-6)


def _reference_top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """vLLM v1's sort-based ``apply_top_k_top_p`` (ascending sort, full vocabulary)."""
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    kth = logits_sort.gather(1, (logits.shape[1] - k).unsqueeze(1))
    logits_sort.masked_fill_(logits_sort < kth, float("-inf"))
    probs_sum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
    mask = probs_sum <= 1 - p.unsqueeze(1)
    mask[:, -1] = False
    logits_sort.masked_fill_(mask, float("-inf"))
    return logits_sort.scatter(1, logits_idx, logits_sort)


def test_top_k_top_p_matches_sort_reference_including_fallback():
    g = torch.Generator().manual_seed(3)
    # Rows 0-3 peaked (nucleus inside 256 candidates), rows 4-7 flat (full-sort fallback path).
    logits = torch.randn(8, 3000, generator=g)
    logits[:4] *= 8
    k = torch.tensor([3000, 10, 3000, 500, 3000, 3000, 2000, 5])
    p = torch.tensor([0.9, 0.5, 1.0, 0.95, 0.9, 0.3, 0.99, 1.0])
    ours = ops.apply_top_k_top_p(logits.clone(), k, p)
    expected = _reference_top_k_top_p(logits.clone(), k, p)
    assert torch.equal(ours.isinf(), expected.isinf())
    assert (~ours[1].isinf()).sum() == 1  # top-2 of a peaked row: one token already has >= 0.5
    assert (~ours[4].isinf()).sum() > 256 and (~ours[6].isinf()).sum() > 256  # the fallback ran


def _empirical(logits_row: torch.Tensor, n: int, **params) -> torch.Tensor:
    torch.manual_seed(123)
    sampled = Sampler()(logits_row.expand(n, -1), [_state(**params)] * n).token_ids
    return torch.bincount(torch.tensor(sampled), minlength=logits_row.shape[0]).float() / n


@pytest.mark.parametrize(
    "params, keep",
    [
        (dict(top_k=3), [0, 1, 2]),
        (dict(top_p=0.7), [0, 1, 2]),  # 0.35 + 0.25 = 0.60 < 0.7, so token 2 (0.15) is needed
        (dict(top_k=4, top_p=0.5), [0, 1]),  # renormalized over 4: 0.35/0.85=0.41, +0.29 >= 0.5
        (dict(temperature=0.5, top_k=5), [0, 1, 2, 3, 4]),
    ],
)
def test_sampling_distribution_matches_renormalized_target(params, keep):
    probs = torch.tensor([0.35, 0.25, 0.15, 0.10, 0.06, 0.05, 0.04])
    logits = probs.log()
    temperature = params.get("temperature", 1.0)
    target = torch.zeros_like(probs)
    target[keep] = torch.softmax(logits[keep] / temperature, dim=-1)
    n = 40000
    freq = _empirical(logits, n, **params)
    assert set(torch.nonzero(freq).flatten().tolist()) == set(keep)
    # Chi-square over the kept tokens; df = len(keep)-1 <= 4, 99.99th percentile < 24.
    chi2 = sum(n * (freq[i] - target[i]) ** 2 / target[i] for i in keep)
    assert chi2 < 24.0, (freq, target)


def test_plain_sampling_distribution_and_sigma_bound():
    probs = torch.tensor([0.5, 0.3, 0.2])
    n = 30000
    freq = _empirical(probs.log(), n)
    sigma = torch.sqrt(probs * (1 - probs) / n)
    assert torch.all((freq - probs).abs() < 5 * sigma), freq


def test_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="do not match"):
        Sampler()(torch.zeros(2, 5), [_state()])


def test_large_batch_runs_and_respects_top_k():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50_000, generator=g)
    states = [_state(prompt=list(range(50)), output=list(range(i, i + 100)), temperature=0.8, top_k=20,
                     top_p=0.9, min_p=0.01, repetition_penalty=1.1, frequency_penalty=0.2, logprobs=5,
                     seed=i if i % 2 else None) for i in range(64)]
    out = Sampler()(logits, states)
    assert len(out.token_ids) == 64
    for row, token in enumerate(out.token_ids):
        # penalties move logits a little, but a top-20 pick must be within the raw top ~60
        assert out.logprobs[row][token].rank <= 60
        assert not math.isnan(out.logprobs[row][token].logprob)


def test_greedy_argmax_of_bf16_logits_is_first_maximum_of_float32_copy():
    # Few distinct values per row (many ties for the maximum), plus -inf and huge entries: the
    # sampler argmaxes bf16 logits without a float32 copy and must pick the first maximal index.
    g = torch.Generator().manual_seed(4)
    levels = torch.tensor([-float("inf"), -3.0e38, -1.5, 0.0, 0.25, 2.5e38])
    logits = levels[torch.randint(0, len(levels), (24, 5000), generator=g)].to(torch.bfloat16)
    logits[0] = -float("inf")  # all -inf: index 0, as for float32
    logits[1, 4321] = float("inf")
    out = Sampler()(logits, [_state(temperature=0.0) for _ in range(24)])
    rows = logits.float().tolist()
    assert out.token_ids == [row.index(max(row)) for row in rows]
    assert out.token_ids[0] == 0 and out.token_ids[1] == 4321


def test_bf16_logits_sample_as_their_float32_cast():
    # Greedy, seeded random (top-k / top-p / min-p), penalties, min_tokens and logprobs rows in one
    # batch: bf16 logits and their exact float32 cast must give the same tokens and logprobs.
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(5)).mul(3).to(torch.bfloat16)

    def states() -> list[SamplingState]:
        return [
            _state(temperature=0.0),
            _state(temperature=0.8, top_k=20, top_p=0.9, seed=1),
            _state(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, output=[3, 4, 4]),
            _state(temperature=0.0, min_tokens=2, eos=[7], logprobs=2),
            _state(temperature=1.2, min_p=0.05, seed=2, logprobs=0),
            _state(temperature=0.0, logprobs=3),
        ]

    out_bf16 = Sampler()(logits, states())
    out_fp32 = Sampler()(logits.float(), states())
    assert out_bf16.token_ids == out_fp32.token_ids
    assert out_bf16.logprobs == out_fp32.logprobs
    assert out_bf16.logprobs[5] is not None and list(out_bf16.logprobs[5])[0] == out_bf16.token_ids[5]
