"""The sampler: one batched call per step turns logits into next tokens (+ logprobs), per request rules.

Order of steps (vLLM v1 ``Sampler.forward``):
  1. logprobs for the output, from the raw logits (vLLM's default "raw logprobs");
  2. min_tokens (forbid stop tokens), repetition penalty (prompt + output), presence/frequency
     penalties (output), the grammar's token mask (structured output: forbidden tokens get -inf);
  3. greedy rows: argmax; random rows: temperature, top-k, top-p, min-p, then the exponential race.

Logits may come in the model dtype (bfloat16): a float32 copy is made only of what needs one (rows
with logprobs, a batch with min_tokens or penalties, random rows). Greedy rows take the argmax of the
logits as given: casting bfloat16 to float32 is exact and monotonic and ``argmax`` returns the first
maximal index, so the token is the same as on a float32 copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from tandem.outputs import Logprob, PositionLogprobs
from tandem.sample import ops
from tandem.sample.grammar import Grammar, allocate_bitmask, fill_bitmask
from tandem.sampling_params import SamplingParams


@dataclass
class SamplingState:
    """Everything the sampler needs to know about one request; the model runner keeps one per request.

    The runner appends each sampled token to ``output_token_ids`` (penalties and min_tokens read it).
    ``generator`` is the request's own RNG when ``params.seed`` is set, so its samples do not depend on
    which other requests share the batch; it advances once per random sample of this request. An
    unseeded request shares its engine's generator (``default_generator``; None: torch's global one).
    ``grammar``: the request's structured-output matcher, or None; ``append`` advances it.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None = None
    grammar: Grammar | None = None

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: list[int] | None = None,
        eos_token_ids: frozenset[int] | set[int] = frozenset(),
        default_generator: torch.Generator | None = None,
    ) -> SamplingState:
        """A new state; copies the token lists and seeds a CPU generator with ``params.seed`` if set,
        else uses ``default_generator`` (the engine's, shared by its unseeded requests)."""
        generator = default_generator
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        return cls(params, list(prompt_token_ids), list(output_token_ids or []), frozenset(eos_token_ids),
                   generator)

    def append(self, token_ids: list[int]) -> None:
        """Records accepted tokens: appends them to ``output_token_ids`` and advances ``grammar``."""
        self.output_token_ids.extend(token_ids)
        if self.grammar is not None:
            self.grammar.accept(token_ids)

    @cached_property
    def prompt_ids_tensor(self) -> torch.Tensor:
        """``[num_prompt_tokens]`` int64 prompt ids, built once (the prompt never changes)."""
        return torch.tensor(self.prompt_token_ids, dtype=torch.int64)

    @property
    def needs_penalties(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0

    def min_tokens_blocked_ids(self) -> list[int]:
        """Token ids forbidden now by ``min_tokens`` (EOS unless ``ignore_eos``, and ``stop_token_ids``)."""
        p = self.params
        if len(self.output_token_ids) >= p.min_tokens:
            return []
        if self.grammar is not None and self.grammar.is_stopped():
            return []  # NOTE: the grammar now allows only EOS; min_tokens must not forbid every token
        eos = [] if p.ignore_eos else sorted(self.eos_token_ids)
        return eos + list(p.stop_token_ids)


@dataclass
class SamplerOutput:
    """One sampled token per row, and that row's logprobs (None unless its request asked for them)."""

    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]


class Sampler:
    """Stateless batched sampler; per-request state lives in ``SamplingState`` (see module docstring)."""

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        """Sample the next token of each row.

        Args:
            logits: ``[num_rows, vocab]`` logits (float32 or bfloat16); row i belongs to ``states[i]``.
                Not modified.
            states: one per row. Seeded rows advance their ``generator``; nothing else changes (the
                caller appends the sampled tokens to ``output_token_ids``).
        Returns:
            ``SamplerOutput`` with ``num_rows`` token ids and logprobs.
        Raises:
            ValueError: if ``logits`` is not 2-D or its row count differs from ``len(states)``.
        """
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} sampling states")
        lp_rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        raw_logprobs = ops.compute_logprobs(logits[lp_rows]) if lp_rows else None

        grammar_rows = [i for i, s in enumerate(states) if s.grammar is not None]
        if grammar_rows or any(s.needs_penalties or s.min_tokens_blocked_ids() for s in states):
            logits = process_logits(logits, states)
        if grammar_rows:
            grammars = [states[i].grammar for i in grammar_rows]
            bitmask = allocate_bitmask(len(grammar_rows), logits.shape[1])
            fill_bitmask(grammars, bitmask)
            apply_grammar_mask(logits, grammar_rows, bitmask)
        sampled = _sample(logits, states)

        logprobs: list[PositionLogprobs | None] = [None] * len(states)
        if raw_logprobs is not None:
            rows_logprobs = position_logprobs(raw_logprobs, sampled[lp_rows], [states[i] for i in lp_rows])
            for row, position in zip(lp_rows, rows_logprobs, strict=True):
                logprobs[row] = position
        return SamplerOutput(token_ids=sampled.tolist(), logprobs=logprobs)


def process_logits(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """A float32 copy of ``logits [R, V]`` after min_tokens and the penalties of each row's state.

    This is what greedy argmax and the random filters see (step 2 of the module docstring); the
    speculative verifier calls it too, with one state per verified position.
    """
    logits = logits.to(torch.float32, copy=True)
    _apply_min_tokens(logits, states)
    _apply_penalties(logits, states)
    return logits


def apply_grammar_mask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Masks ``logits [R, V]`` rows ``rows`` (in place) with ``bitmask [len(rows), ceil(V / 32)]``."""
    ops.apply_token_bitmask(logits, bitmask, rows)


def _apply_min_tokens(logits: torch.Tensor, states: list[SamplingState]) -> None:
    rows: list[int] = []
    token_ids: list[int] = []
    for row, state in enumerate(states):
        blocked = state.min_tokens_blocked_ids()
        rows.extend([row] * len(blocked))
        token_ids.extend(blocked)
    ops.apply_min_tokens(logits, rows, token_ids)


def _apply_penalties(logits: torch.Tensor, states: list[SamplingState]) -> None:
    """Repetition, presence and frequency penalties, computed only on the rows that use them."""
    rows = [i for i, s in enumerate(states) if s.needs_penalties]
    if not rows:
        return
    vocab_size = logits.shape[1]
    chosen = [states[i] for i in rows]
    outputs = [torch.tensor(s.output_token_ids, dtype=torch.int64) for s in chosen]
    output_index, output_counts = ops.flat_token_counts(outputs, vocab_size)
    prompt_index, _ = ops.flat_token_counts([s.prompt_ids_tensor for s in chosen], vocab_size)
    seen_index = torch.unique(torch.cat([prompt_index, output_index]))

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(s.params, name) for s in chosen], dtype=torch.float32)

    index = torch.tensor(rows)
    sub = logits.index_select(0, index)
    ops.apply_repetition_penalty(sub, seen_index, column("repetition_penalty"))
    ops.apply_presence_frequency_penalties(
        sub, output_index, output_counts, column("presence_penalty"), column("frequency_penalty")
    )
    logits.index_copy_(0, index, sub)


def _sample(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """``[num_rows]`` int64 tokens: argmax for greedy rows, filtered random sampling for the others.

    ``logits`` (float32 or bfloat16) is not modified; the random rows are filtered in a float32 copy.
    """
    sampled = ops.greedy_sample(logits)
    random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
    if random_rows:
        index = torch.tensor(random_rows)
        chosen = [states[i] for i in random_rows]
        probs = filtered_probs(logits.index_select(0, index).float(), [s.params for s in chosen])
        sampled[index] = ops.random_sample(probs, [s.generator for s in chosen])
    return sampled


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p (HF warper order) on ``[R, V]`` logits; returns ``[R, V]`` probs.

    Changes ``logits`` in place (pass a copy to keep them).
    """
    vocab_size = logits.shape[1]
    ops.apply_temperature(logits, torch.tensor([p.temperature for p in params], dtype=torch.float32))
    k = p_top = None
    if any(0 < p.top_k < vocab_size for p in params):
        k = torch.tensor([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params])
    if any(p.top_p < 1.0 for p in params):
        p_top = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    logits = ops.apply_top_k_top_p(logits, k, p_top)
    if any(p.min_p > 0.0 for p in params):
        ops.apply_min_p(logits, torch.tensor([p.min_p for p in params], dtype=torch.float32))
    return logits.softmax(dim=-1)


def position_logprobs(
    logprobs: torch.Tensor, sampled: torch.Tensor, states: list[SamplingState]
) -> list[PositionLogprobs]:
    """Per row: the sampled token first, then the row's top-N (``params.logprobs``), ranks from 1."""
    return positions_with_top(logprobs, sampled, [s.params.logprobs or 0 for s in states])


def positions_with_top(logprobs: torch.Tensor, token_ids: torch.Tensor, num_tops: list[int]) -> list[PositionLogprobs]:
    """Per row of ``logprobs [R, V]``: ``token_ids[row]`` (its logprob and vLLM rank) and the row's
    ``num_tops[row]`` most likely tokens (ranks 1..N). ``token_ids``: ``[R]`` int64."""
    top_ids, top_lps, token_lps, token_ranks = ops.gather_logprobs(logprobs, token_ids, max(num_tops, default=0))
    top_ids_l, top_lps_l = top_ids.tolist(), top_lps.tolist()
    result: list[PositionLogprobs] = []
    for row, (token, lp, rank) in enumerate(zip(token_ids.tolist(), token_lps.tolist(),
                                                token_ranks.tolist(), strict=True)):
        position: PositionLogprobs = {token: Logprob(lp, rank)}
        for j in range(num_tops[row]):
            position[top_ids_l[row][j]] = Logprob(top_lps_l[row][j], j + 1)
        result.append(position)
    return result
