"""Acceptance counters of speculative decoding (plain integers; the scheduler owns them, no tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Cumulative counters over verification steps (vLLM v1's spec-decode metrics).

    A *draft* is one verification of a request's draft tokens in one step. ``num_draft_tokens``
    counts the draft tokens verified, ``num_accepted_tokens`` those accepted, and
    ``num_accepted_tokens_per_pos[j]`` how often the draft at position j (0-based) was accepted.
    """

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Counts one verification of ``num_draft_tokens`` drafts of which the first ``num_accepted_tokens``
        were accepted. Changes every counter.

        Raises:
            ValueError: more accepted than drafted, or more drafts than ``num_speculative_tokens``.
        """
        if not 0 <= num_accepted_tokens <= num_draft_tokens <= self.num_speculative_tokens:
            raise ValueError(f"cannot accept {num_accepted_tokens} of {num_draft_tokens} drafts "
                             f"(k = {self.num_speculative_tokens})")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / verified draft tokens (0.0 before any draft)."""
        return acceptance_rate(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per verification step: 1 (the target's own token) + accepted drafts per step."""
        return mean_acceptance_length(self.num_accepted_tokens, self.num_drafts)


def acceptance_rate(num_accepted_tokens: int, num_draft_tokens: int) -> float:
    """Accepted / verified draft tokens (0.0 before any draft)."""
    return num_accepted_tokens / num_draft_tokens if num_draft_tokens else 0.0


def mean_acceptance_length(num_accepted_tokens: int, num_drafts: int) -> float:
    """Tokens per verification step: 1 + accepted drafts per step (0.0 before any draft)."""
    return 1.0 + num_accepted_tokens / num_drafts if num_drafts else 0.0
