"""Batched sampling steps on a ``[num_rows, vocab]`` logits tensor, one short function each.

The order and semantics follow vLLM v1 (``vllm/v1/sample/``) and Hugging Face ``transformers`` logits
processors. Every function works on whole batches with tensor ops: nothing loops over vocabulary
entries or tokens; ``random_sample`` loops over rows, because each seeded request owns a generator, and
``apply_token_bitmask`` fills each masked row with one numpy call.
Functions named ``apply_*`` modify ``logits`` in place and also return it.
"""

from __future__ import annotations

import numpy as np
import torch

from tandem import kernels
from tandem.kernels import registry

_NEG_INF = float("-inf")


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Natural-log probabilities of each row: ``log_softmax`` over the vocabulary.

    Args:
        logits: ``[R, V]`` raw logits.
    Returns:
        ``[R, V]`` float32 log-probabilities (a new tensor).
    """
    return torch.log_softmax(logits.float(), dim=-1)


def gather_logprobs(
    logprobs: torch.Tensor, sampled: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampled token's log-probability and rank, plus the ``num_top`` most likely tokens.

    Rank follows vLLM v1: 1 + the number of tokens strictly more likely than the sampled one.

    Args:
        logprobs: ``[R, V]`` log-probabilities.
        sampled: ``[R]`` int64 sampled token ids.
        num_top: N >= 0, how many top tokens to return per row.
    Returns:
        ``(top_ids [R, N] int64, top_logprobs [R, N], sampled_logprobs [R], sampled_ranks [R] int64)``;
        top tokens are in decreasing probability, so the rank of column j is j + 1.
    """
    sampled_logprobs = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
    sampled_ranks = (logprobs > sampled_logprobs.unsqueeze(1)).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return top_ids, top_logprobs, sampled_logprobs, sampled_ranks


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
    """Forbid (-inf) every token whose bit is clear: bit ``j`` of word ``w`` allows token ``32 w + j``.

    Args:
        logits: ``[R, V]``, modified in place (float32 or bfloat16).
        bitmask: ``[M, ceil(V / 32)]`` int32 (llguidance's layout); a token past ``32 * W`` is forbidden.
        rows: the logits row of each bitmask row (default: row i for bitmask row i, M == R).
    """
    # NOTE: numpy unpacks the bits and fills -inf where they are clear, on one thread. Real JSON-schema
    # masks over 49,152 tokens (2 threads, load 2-3): 46-64 us per row vs 154-269 us for the tensor ops
    # (shift, and, bool, invert, masked_fill); 16 rows 0.41-0.91 vs 1.5-3.8 ms. Random bits (no real
    # mask looks like that) are the worst case for the fill's branches: 379 vs 261 us per row.
    words = np.invert(bitmask.numpy()).astype("<i4", copy=False)  # NOTE: little-endian: byte k = bits 8k..8k+7
    forbidden = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little").view(np.bool_)
    vocab_size = logits.shape[1]
    if forbidden.shape[1] < vocab_size:
        forbidden = np.pad(forbidden, ((0, 0), (0, vocab_size - forbidden.shape[1])), constant_values=True)
    forbidden = forbidden[:, :vocab_size]
    rows = list(range(bitmask.shape[0])) if rows is None else rows
    if logits.dtype == torch.float32 and logits.is_contiguous():
        out = logits.numpy()
        for i, row in enumerate(rows):
            np.copyto(out[row], _NEG_INF, where=forbidden[i])
        return logits
    index = torch.tensor(rows)
    sub = logits.index_select(0, index).masked_fill_(torch.from_numpy(forbidden), _NEG_INF)
    return logits.index_copy_(0, index, sub)


def apply_min_tokens(logits: torch.Tensor, rows: list[int], token_ids: list[int]) -> torch.Tensor:
    """Forbid stop tokens (EOS, ``stop_token_ids``) in rows that have not reached ``min_tokens``.

    Args:
        logits: ``[R, V]``, modified in place.
        rows, token_ids: equal-length lists; ``logits[rows[i], token_ids[i]]`` becomes -inf.
    """
    if rows:
        logits[torch.tensor(rows), torch.tensor(token_ids)] = _NEG_INF
    return logits


def flat_token_counts(token_ids: list[torch.Tensor], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which tokens occur in each row's list, and how often, as sparse flat indices.

    A sparse ``bincount``: keys ``row * vocab_size + token`` are counted with one ``torch.unique``, so
    the cost follows the number of tokens, not ``rows x vocab`` (a dense ``[R, V]`` count tensor is
    tens of MB at V = 50k and dominates a CPU step).

    Args:
        token_ids: R int64 tensors of any length (one per row); ids in ``[0, vocab_size)``.
        vocab_size: V.
    Returns:
        ``(flat_index [N] int64 sorted and unique, counts [N] int64)``; ``flat_index // V`` is the row.
    """
    lengths = torch.tensor([len(ids) for ids in token_ids])
    rows = torch.repeat_interleave(torch.arange(len(token_ids)), lengths)
    keys = torch.cat(token_ids) + rows * vocab_size if token_ids else torch.empty(0, dtype=torch.int64)
    return torch.unique(keys, return_counts=True)


def apply_repetition_penalty(
    logits: torch.Tensor, seen_index: torch.Tensor, penalties: torch.Tensor
) -> torch.Tensor:
    """CTRL repetition penalty (Keskar et al. 2019, as in HF ``RepetitionPenaltyLogitsProcessor``).

    For each token already seen (prompt or output): a positive logit is divided by the penalty,
    a negative one multiplied by it, so penalty > 1 always makes the token less likely.

    Args:
        logits: ``[R, V]`` contiguous, modified in place.
        seen_index: ``[N]`` unique flat indices ``row * V + token`` of the seen tokens.
        penalties: ``[R]`` float32 penalties (> 0; 1.0 = none).
    """
    flat = logits.view(-1)
    values = flat[seen_index]
    scale = penalties[seen_index // logits.shape[1]]
    flat[seen_index] = torch.where(values > 0, values / scale, values * scale)
    return logits


def apply_presence_frequency_penalties(
    logits: torch.Tensor,
    output_index: torch.Tensor,
    output_counts: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """OpenAI presence and frequency penalties over output tokens.

    ``logit[j] -= frequency * count[j] + presence * (count[j] > 0)``
    (https://platform.openai.com/docs/advanced-usage, "Frequency and presence penalties").

    Args:
        logits: ``[R, V]`` contiguous, modified in place.
        output_index, output_counts: ``[N]`` from ``flat_token_counts`` of the output tokens.
        presence, frequency: ``[R]`` float32 penalties in [-2, 2].
    """
    rows = output_index // logits.shape[1]
    flat = logits.view(-1)
    flat[output_index] -= frequency[rows] * output_counts + presence[rows]
    return logits


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature (> 0).

    Args:
        logits: ``[R, V]``, modified in place.
        temperature: ``[R]`` float32, > 0 (greedy rows never reach this step).
    """
    return logits.div_(temperature.unsqueeze(1))


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Keep the ``k`` largest logits, then the smallest top set with probability mass >= ``p``.

    Same rule as vLLM v1 ``apply_top_k_top_p`` and HF ``TopKLogitsWarper``/``TopPLogitsWarper``:
    top-p runs on the distribution renormalized after top-k, and the most likely token always
    survives. Both filters are thresholds on values, so ties with the last kept value are kept.

    Args:
        logits: ``[R, V]``, modified in place.
        k: ``[R]`` int64 in [1, V] (V = no top-k) or None.
        p: ``[R]`` float32 in (0, 1] (1.0 = no top-p) or None.
    Returns:
        ``logits`` with removed tokens at -inf.
    """
    if k is not None:
        _apply_top_k(logits, k)
    if p is not None:
        _apply_top_p(logits, p)
    return logits


def _apply_top_k(logits: torch.Tensor, k: torch.Tensor) -> None:
    # NOTE: topk(max k) avoids a full vocabulary sort (vLLM's top-k-only fast path).
    no_top_k = k >= logits.shape[1]
    k = k.masked_fill(no_top_k, 1)
    top_values = logits.topk(int(k.max()), dim=1).values
    kth_value = top_values.gather(1, (k - 1).unsqueeze(1))
    kth_value.masked_fill_(no_top_k.unsqueeze(1), _NEG_INF)
    logits.masked_fill_(logits < kth_value, _NEG_INF)


def _apply_top_p(logits: torch.Tensor, p: torch.Tensor, num_candidates: int = 256) -> None:
    # NOTE: a full sort of 64 x 50k logits costs ~100 ms on two cores. The nucleus is almost always
    # inside the ``num_candidates`` most likely tokens, found with topk; rows whose candidates hold
    # less than ``p`` of the mass fall back to a full sort.
    probs = logits.softmax(dim=-1)
    top = probs.topk(min(num_candidates, probs.shape[1]), dim=-1).values
    threshold, covered = _top_p_threshold(top, p)
    missing = (~covered & (p < 1.0)).nonzero().squeeze(1)
    if missing.numel() > 0:
        full = probs[missing].sort(dim=-1, descending=True).values
        threshold[missing] = _top_p_threshold(full, p[missing])[0]
    threshold.masked_fill_(p >= 1.0, 0.0)
    logits.masked_fill_(probs < threshold.unsqueeze(1), _NEG_INF)


def _top_p_threshold(sorted_probs: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest kept probability per row, and whether the kept set lies inside ``sorted_probs``.

    ``sorted_probs``: ``[R, C]`` the C largest probabilities, descending. A token is kept when the
    mass of the tokens before it is < p (equivalently, vLLM removes it when the ascending cumulative
    mass up to it is <= 1 - p). Returns ``([R] threshold, [R] bool covered)``.
    """
    cumulative = sorted_probs.cumsum(dim=-1)
    before = cumulative - sorted_probs
    num_kept = (before < p.unsqueeze(1)).sum(dim=-1).clamp_min_(1)
    threshold = sorted_probs.gather(1, (num_kept - 1).unsqueeze(1)).squeeze(1)
    return threshold, cumulative[:, -1] >= p


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Min-p filtering (Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling").

    Removes tokens whose probability is below ``min_p`` times the row's largest probability.

    Args:
        logits: ``[R, V]``, modified in place.
        min_p: ``[R]`` float32 in [0, 1] (0 = off).
    """
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, _NEG_INF)


def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """Argmax of each row (the first maximal index, as ``torch.max`` documents).

    ``logits``: ``[R, V]`` float32 or bfloat16; returns ``[R]`` int64 token ids.
    """
    # NOTE: the kernel where there is one (kernels/csrc/avx2/argmax.cpp, the same indices): PyTorch's bf16
    # max took 110-180 us for one [1, 49152] row on a Zen 1 core, ~1% of a default-model decode step.
    # Else Tensor.max(dim) rather than argmax: on bfloat16 CPU tensors argmax is not vectorized (7.9 vs
    # 1.4 ms for [16, 151936] on one Zen 4 core); on float32 the two take the same time.
    if (logits.dim() == 2 and logits.dtype in (torch.bfloat16, torch.float32) and logits.shape[1] > 0
            and logits.stride(1) == 1 and registry.use("argmax")):
        return kernels.argmax(logits)
    return logits.max(dim=-1).indices


def random_sample(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Sample one token per row with the exponential race (as vLLM v1 ``random_sample``).

    With ``q_j ~ Exponential(1)`` i.i.d., ``argmax_j p_j / q_j`` is distributed as ``p`` (it is the
    Gumbel-max trick in another form), and needs no cumulative sum. Rows with a generator draw their
    ``q`` from it, so a seeded request's sample depends only on its own generator and probabilities,
    not on the batch; rows without one share a single draw from the global generator.

    Args:
        probs: ``[R, V]`` probabilities (rows sum to 1; zeros are never sampled).
        generators: R entries, a ``torch.Generator`` or None.
    Returns:
        ``[R]`` int64 token ids.
    """
    u = torch.empty_like(probs)
    if any(g is None for g in generators):
        u.uniform_()
    for row, generator in enumerate(generators):
        if generator is not None:
            u[row].uniform_(generator=generator)
    # NOTE: q = -log(U) is Exponential(1) (inverse CDF) and is 4x faster than Tensor.exponential_ on
    # CPU. U in [0, 1) makes q > 0 or +inf, never 0, so a p=0 token never wins (0/inf = 0).
    q = u.log_().neg_()
    return probs.div(q).argmax(dim=-1)
