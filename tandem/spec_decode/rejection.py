"""Verification of draft tokens: greedy prefix matching and speculative (rejection) sampling.

``rejection_sample`` is the whole acceptance rule for one request (gpt-fast style); ``verify_batch``
prepares the target distributions of every verified position of a step in one batched pass, with
each request's min_tokens, penalties, temperature, top-k, top-p and min-p, and then calls it per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.outputs import PositionLogprobs
from tandem.sample import ops
from tandem.sample.grammar import allocate_bitmask, fill_bitmask
from tandem.sample.sampler import (
    SamplingState,
    apply_grammar_mask,
    filtered_probs,
    position_logprobs,
    process_logits,
)


def rejection_sample(
    draft_token_ids: list[int],
    target: torch.Tensor,
    draft_probs: torch.Tensor | None,
    greedy: bool,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Verify s draft tokens against the target; returns the accepted drafts plus one target token.

    Greedy: accept the longest prefix of drafts equal to the target's argmax, then append the target's
    argmax at the first mismatch (or, if all s match, at position s: the bonus token).

    Sampled (speculative sampling, Leviathan et al. 2023, "Fast Inference from Transformers via
    Speculative Decoding", Algorithm 1; Chen et al. 2023, "Accelerating Large Language Model Decoding
    with Speculative Sampling", Algorithm 2): draft x_j was drawn from q_j. Accept it with probability
    min(1, p_j(x_j) / q_j(x_j)); at the first rejection, sample from normalize(max(0, p_j - q_j)) and
    stop; if all s are accepted, sample a bonus token from p_s. Every output token is then distributed
    exactly as the target p. A deterministic proposer (n-gram lookup) has one-hot q.

    Args:
        draft_token_ids: the s >= 0 draft tokens.
        target: ``[s + 1, V]``: processed logits when ``greedy``, else the target probabilities p (after
            temperature, top-k, top-p, min-p and penalties) at each verified position.
        draft_probs: ``[s, V]`` draft probabilities q, or None for one-hot q on the drafts.
        greedy: the request decodes greedily.
        generator: the request's own RNG (None = torch's global one); used only when sampling.
    Returns:
        1 to s + 1 token ids.
    """
    s = len(draft_token_ids)
    if greedy:
        target_ids = target.argmax(dim=-1).tolist()
        n = 0
        while n < s and draft_token_ids[n] == target_ids[n]:
            n += 1
        return draft_token_ids[:n] + [target_ids[n]]
    p = target
    drafts = torch.tensor(draft_token_ids, dtype=torch.int64)
    if draft_probs is None:
        q = torch.zeros(s, p.shape[1], dtype=p.dtype)
        q[torch.arange(s), drafts] = 1.0
    else:
        q = draft_probs[:s].to(p.dtype)
    positions = torch.arange(s)
    p_x, q_x = p[positions, drafts], q[positions, drafts]
    # Accept x_j iff u_j < p_j(x_j) / q_j(x_j), i.e. with probability min(1, p/q); u_j ~ U[0, 1).
    u = torch.rand(s, generator=generator, dtype=p.dtype)
    rejected = (u * q_x >= p_x).nonzero()
    if rejected.numel() == 0:
        return draft_token_ids + [_sample(p[s], generator)]
    n = int(rejected[0, 0])
    residual = (p[n] - q[n]).clamp_(min=0.0)
    if not residual.sum() > 0:
        residual = p[n]  # NOTE: p == q up to rounding; then rejection had probability ~0 anyway
    return draft_token_ids[:n] + [_sample(residual, generator)]


def _sample(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from unnormalized non-negative ``weights [V]`` (the sampler's exponential race)."""
    return int(ops.random_sample(weights.unsqueeze(0), [generator])[0])


@dataclass
class VerifyRow:
    """One speculating request of a step: its sampling state (before this step's tokens) and drafts.

    ``draft_probs``: ``[>= s, V]`` q of the drafts, or None when they were proposed deterministically.
    """

    state: SamplingState
    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None = None


@dataclass
class VerifyResult:
    """Accepted drafts plus the target's token (1 to s + 1 ids), and their logprobs when asked."""

    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None


def verify_batch(logits: torch.Tensor, rows: list[VerifyRow]) -> list[VerifyResult]:
    """Verify every speculating row of a step.

    Args:
        logits: ``[sum(s_r + 1), V]`` raw target logits, row r's s_r + 1 verified positions in order
            (the last scheduled real token, then each draft). Not modified.
        rows: one per speculating request, in the order of ``logits``.
    Returns:
        One ``VerifyResult`` per row. Changes: seeded rows advance their generator.
    Raises:
        ValueError: ``logits`` does not have one row per verified position.
    """
    counts = [len(r.draft_token_ids) + 1 for r in rows]
    if logits.dim() != 2 or logits.shape[0] != sum(counts):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {sum(counts)} verified positions")
    states = [st for r in rows for st in _position_states(r.state, r.draft_token_ids)]
    target = process_logits(logits, states)
    _mask_grammar_rows(target, rows, counts)
    random_positions = [i for i, st in enumerate(states) if not st.params.greedy]
    if random_positions:
        index = torch.tensor(random_positions)
        probs = filtered_probs(target.index_select(0, index), [states[i].params for i in random_positions])
        target.index_copy_(0, index, probs)
    results = []
    start = 0
    for row, count in zip(rows, counts, strict=True):
        end = start + count
        params = row.state.params
        tokens = rejection_sample(row.draft_token_ids, target[start:end], row.draft_probs, params.greedy,
                                  row.state.generator)
        logprobs = None
        if params.logprobs is not None:
            raw = ops.compute_logprobs(logits[start : start + len(tokens)])
            logprobs = position_logprobs(raw, torch.tensor(tokens), [row.state] * len(tokens))
        results.append(VerifyResult(tokens, logprobs))
        start = end
    return results


def _mask_grammar_rows(target: torch.Tensor, rows: list[VerifyRow], counts: list[int]) -> None:
    """Masks the verified positions of rows with a grammar: position j with the grammar after drafts
    ``[:j]`` (so a draft the grammar forbids is always rejected, and the token that replaces it is
    allowed). The matchers end where they started; the accepted tokens advance them afterwards."""
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    chosen = [i for i, r in enumerate(rows) if r.state.grammar is not None]
    if not chosen:
        return
    positions = [p for i in chosen for p in range(starts[i], starts[i] + counts[i])]
    bitmask = allocate_bitmask(len(positions), target.shape[1])
    fill_bitmask([rows[i].state.grammar for i in chosen], bitmask, [rows[i].draft_token_ids for i in chosen])
    apply_grammar_mask(target, positions, bitmask)


def _position_states(state: SamplingState, draft_token_ids: list[int]) -> list[SamplingState]:
    """The sampling state at each verified position: position j has seen drafts ``[:j]`` as output.

    Penalties and min_tokens depend on the output so far; without them every position shares ``state``.
    """
    num_positions = len(draft_token_ids) + 1
    min_tokens_done = len(state.output_token_ids) >= state.params.min_tokens
    if not state.needs_penalties and min_tokens_done:
        return [state] * num_positions
    result = []
    for j in range(num_positions):
        position = SamplingState(state.params, state.prompt_token_ids,
                                 state.output_token_ids + draft_token_ids[:j], state.eos_token_ids,
                                 state.generator)
        if state.needs_penalties:
            position.__dict__["prompt_ids_tensor"] = state.prompt_ids_tensor  # NOTE: share the cached tensor
        result.append(position)
    return result
