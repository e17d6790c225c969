"""Prompt logprobs (vLLM's ``prompt_logprobs``), computed in the prefill's own forward pass, chunk by chunk.

A prefill chunk runs prompt positions ``[start, start + n)``; the logits at position p give the
log-probability of prompt token p + 1 (the last prompt position predicts the first output token, so it
has no prompt logprob). For each chunk the model runner hands the hidden states of those positions
here; logits and their log-softmax are computed ``ROWS_PER_PASS`` rows at a time in float32 and only
the actual next token and the top-N of each row are kept, so memory stays ``ROWS_PER_PASS x vocab``
floats whatever the prompt length (the full ``[prompt, vocab]`` logits never exist).

A prefix-cache hit has no logits, so the scheduler gives a request that wants prompt logprobs no
prefix hit until its first token is sampled (as vLLM does); its written blocks still enter the cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.outputs import PromptLogprobs
from tandem.sample import ops
from tandem.sample.sampler import positions_with_top

ROWS_PER_PASS = 128  # logits rows per log-softmax: 128 x a 151936-token vocabulary = 78 MB of float32


class PromptLogprobsState:
    """One request's prompt logprobs while its prompt is computed (kept by the model runner).

    ``positions[i]`` holds prompt token i's entry (``positions[0]`` stays None). A recomputed chunk
    (after a preemption) overwrites its positions. ``sent`` once handed to the first sampled output.
    """

    def __init__(self, num_prompt_tokens: int, num_top: int) -> None:
        self.num_top = num_top
        self.positions: PromptLogprobs = [None] * num_prompt_tokens
        self.sent = False

    def add_chunk(
        self, compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
        prompt_token_ids: list[int], start: int,
    ) -> None:
        """Records the prompt logprobs predicted by one prefill chunk.

        Args:
            compute_logits: ``hidden [N, H] -> float32 logits [N, vocab]`` (the model's lm head).
            hidden: ``[n, H]`` hidden states of the chunk's positions ``start .. start + n - 1``.
            prompt_token_ids: the whole prompt.
            start: the chunk's first position.
        Changes: ``positions[start + 1 .. start + n]`` (within the prompt).
        """
        stop = min(start + hidden.shape[0], len(prompt_token_ids) - 1)  # positions whose next token is prompt
        for first in range(start, stop, ROWS_PER_PASS):
            last = min(first + ROWS_PER_PASS, stop)
            logprobs = ops.compute_logprobs(compute_logits(hidden[first - start : last - start]))
            targets = torch.tensor(prompt_token_ids[first + 1 : last + 1], dtype=torch.int64)
            rows = positions_with_top(logprobs, targets, [self.num_top] * (last - first))
            self.positions[first + 1 : last + 1] = rows

    def take(self) -> PromptLogprobs:
        """The prompt's logprobs, once (marks them sent and drops the reference). Changes: ``sent``."""
        positions, self.positions, self.sent = self.positions, [], True
        return positions

