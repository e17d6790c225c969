"""The proposer protocol: after each step's sampling, propose the next step's draft tokens per request.

Proposers run on the model-runner side (as in vLLM v1), so draft probabilities (tensors) never pass
through the scheduler; only the draft token ids do. A proposer sees every scheduled row of the step,
because a draft model keeps its own KV cache in step with the target's (see ``draft_model.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.sample import ops
from tandem.sample.sampler import SamplingState, filtered_probs


@dataclass
class ProposeRow:
    """One scheduled row of the step, after verification.

    ``token_ids`` are the tokens whose K/V a draft model must write this step, from position
    ``num_computed`` on: the row's real tokens, its accepted drafts and, when it proposes, the token
    the target just produced (the context of the first proposal). ``num_drafts`` (0 = propose nothing)
    is capped by the context and ``max_tokens``. ``state`` holds prompt + output including this step's
    tokens, the sampling parameters and the request's generator. ``block_ids`` covers
    ``num_computed + len(token_ids) + num_drafts - 1`` positions (lookahead slots).
    """

    request_id: str
    token_ids: list[int]
    num_computed: int
    block_ids: list[int]
    num_drafts: int
    state: SamplingState


@dataclass
class Proposal:
    """Draft tokens for one row, and ``probs [len(token_ids), V]`` q they were drawn from (None: one-hot)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    """Proposes draft tokens; ``uses_kv_cache`` says whether it keeps a paged KV cache of its own."""

    uses_kv_cache: bool

    def propose(self, rows: list[ProposeRow]) -> list[Proposal | None]:
        """One proposal per row (None for rows with ``num_drafts == 0`` or no guess).

        Changes: the proposer's KV cache (draft models) and seeded rows' generators (sampled drafts).
        """
        ...

    def stats(self) -> dict[str, float]:
        """Cumulative counters of the proposer's own work (e.g. draft forward passes, draft tokens run)."""
        ...


def choose_tokens(logits: torch.Tensor, states: list[SamplingState]) -> tuple[list[int], torch.Tensor | None]:
    """Draft tokens from draft ``logits [R, V]``: argmax for greedy rows, a sample from q otherwise.

    q is the draft's softmax after the row's temperature, top-k, top-p and min-p (no penalties), drawn
    with the row's own generator; any q is valid for speculative sampling as long as the verifier sees
    the same q. Returns ``(R token ids, q [R, V] float32 or None when every row is greedy)``; q rows of
    greedy rows are one-hot on their token.
    """
    logits = logits.float()
    tokens = ops.greedy_sample(logits)
    random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
    if not random_rows:
        return tokens.tolist(), None
    index = torch.tensor(random_rows)
    chosen = [states[i] for i in random_rows]
    probs = filtered_probs(logits.index_select(0, index), [s.params for s in chosen])
    tokens[index] = ops.random_sample(probs, [s.generator for s in chosen])
    q = torch.nn.functional.one_hot(tokens, logits.shape[1]).float()
    q[index] = probs
    return tokens.tolist(), q
