"""A request inside the engine core: its tokens, counters and status. No tensors here."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Lifecycle of a request in the scheduler."""

    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks allocated, KV of its first tokens on the wire
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop token id
    FINISHED_LENGTH = "finished_length"  # max_tokens or the context limit
    FINISHED_ABORTED = "finished_aborted"  # client went away or a stop string matched

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )

    @property
    def finish_reason(self) -> str | None:
        """OpenAI ``finish_reason`` for a finished status (``None`` while unfinished)."""
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass
class Request:
    """One sequence to complete (a child of an ``n > 1`` prompt is its own ``Request``).

    Counters (all in tokens), following vLLM v1's single scheduling rule:
      - ``num_tokens`` = prompt + output tokens known so far.
      - ``num_computed_tokens`` = tokens whose KV is in the cache. The scheduler schedules
        ``num_tokens - num_computed_tokens`` (capped by budget and chunk size) each step.
      - ``num_cached_tokens`` = prompt tokens served by the prefix cache on first schedule (-1: not yet).
      - ``spec_token_ids`` = draft tokens to verify at the next step (speculative decoding); a step that
        verifies s of them schedules ``1 + s`` tokens and keeps only the accepted ones.

    Admission: a waiting request is taken only when ``is_ready()``: not ``WAITING_FOR_REMOTE_KV``
    and ``ready_check`` (a generic hook, e.g. "its grammar has compiled") returns True; the policy
    skips it meanwhile without blocking the queue behind it. ``priority`` (from the sampling
    params) orders the queue under the "priority" policy. ``kv_lease_id``: when set, the request's
    blocks are held under this lease when it finishes (not when aborted) instead of being freed.
    ``block_hash_root``: the parent hash of its first KV block (None: ``hashing.ROOT_HASH``), set by
    ``EngineCore.add_request`` from ``ModelRunner.block_hash_root``.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | None = None  # the stop token id that ended the request, if any
    max_tokens: int = 0  # effective max new tokens (resolved against the context length)
    first_scheduled_time: float | None = None
    block_hashes: list[int] = field(default_factory=list)
    # Speculative decoding: drafts proposed after the last step, verified in the next one (not part of
    # num_tokens until accepted), and cumulative verification counters (tokens).
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    ready_check: Callable[[], bool] | None = None
    kv_lease_id: str | None = None
    block_hash_root: int | None = None
    queued_step: int = 0  # the scheduler's step count when it last entered the waiting queue (lpm aging)

    @property
    def priority(self) -> int:
        """Admission priority under the "priority" policy: lower first (vLLM), ties by arrival."""
        return self.sampling_params.priority

    def is_ready(self) -> bool:
        """True when admission may take this waiting request now (calls ``ready_check``)."""
        if self.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            return False
        return self.ready_check is None or bool(self.ready_check())

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """``num_tokens`` plus the pending draft tokens."""
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output token ids (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output, without concatenating the whole sequence."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]
