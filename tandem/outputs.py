"""Typed data passed between stages: scheduler -> model runner -> scheduler -> output processor."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.sampling_params import SamplingParams


@dataclass
class Logprob:
    """Log-probability of one token at one position (natural log); ``rank`` 1 = most likely."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# One position's logprobs: token id -> Logprob; holds the sampled token plus the top-N.
PositionLogprobs = dict[int, Logprob]
# A prompt's logprobs (vLLM's ``PromptLogprobs``): one entry per prompt token, holding that token and the
# top-N at its position; the first entry is None (no token precedes it).
PromptLogprobs = list[PositionLogprobs | None]


@dataclass
class NewRequestData:
    """A request the model runner has not seen yet: what it needs to keep per-request sampling state."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()


@dataclass
class ScheduledRequest:
    """One row of a step: run ``token_ids`` at positions ``num_computed_tokens ...``.

    ``block_ids`` is the request's whole block table after this step's allocation (with speculation
    it may also cover a few lookahead slots where a draft model writes its proposals' K/V).
    ``sample`` is True when the chunk reaches the last known token, so a next token is sampled.
    ``num_spec_tokens``: the last ``num_spec_tokens`` of ``token_ids`` are draft tokens to verify; the
    runner then returns 1 to ``num_spec_tokens + 1`` tokens for this row.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sample: bool
    num_spec_tokens: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def spec_token_ids(self) -> list[int]:
        """The draft tokens of this row (a new list; empty without speculation)."""
        return self.token_ids[len(self.token_ids) - self.num_spec_tokens :]


@dataclass
class SchedulerOutput:
    """What the scheduler decided for one step (the model runner's only input)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    # The runner drops its per-request state (sampling generators, token history) for these.
    finished_request_ids: set[str] = field(default_factory=set)
    num_preempted: int = 0

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """What one forward pass produced, per request that sampled (``ScheduledRequest.sample``).

    With speculation a row's ``sampled_token_ids`` holds its accepted drafts plus one token from the
    target (1 to k + 1 tokens), and ``spec_token_ids`` the drafts proposed for the next step.
    ``failed``: requests that cannot go on, and why (their structured-output matcher failed); the
    scheduler ends them with an error and ignores their tokens.
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Per request: one PositionLogprobs per sampled token (only for requests that asked for logprobs).
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    # Per request that asked for prompt logprobs: the whole prompt's, sent with its first sampled token.
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """New tokens of one request after a step; ``finish_reason`` set when it ended."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Speculative decoding, cumulative for this request: drafts verified and drafts accepted (tokens).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # with the request's first output only
    # Disaggregated prefill (``tandem/disagg``): what a prefill leg hands to the decode side, or how a
    # decode leg got its prompt's KV; set on the request's last output only.
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a prompt (vLLM's ``CompletionOutput``)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Speculative decoding (Tandem): draft tokens verified for this completion, and how many were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one prompt's completions (vLLM's ``RequestOutput``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # With ``SamplingParams.prompt_logprobs``: one entry per prompt token, the first None (vLLM's shape).
    # Delta outputs carry it once, in the first output after the prompt was computed.
    prompt_logprobs: PromptLogprobs | None = None
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's field: see ``EngineCoreOutput``
