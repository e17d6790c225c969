"""The messages between the front end and the engine-core process, as msgspec structs.

Wire format: msgpack via ``msgspec`` into these typed messages (never pickle from a socket). Inputs
(front end -> core) are ``InputMessage``, outputs (core -> front end) ``OutputMessage``; both are
tagged unions. No torch: the front end imports this module.
"""

from __future__ import annotations

import msgspec

from tandem.kv_cache.events import KVEventBatch
from tandem.outputs import EngineCoreOutput
from tandem.sampling_params import SamplingParams


# ---- front end -> core ----
class WireRequest(msgspec.Struct):
    """One engine request (a child of an ``n > 1`` prompt is its own). ``arrival_time``: monotonic s."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    max_tokens: int
    arrival_time: float


class AddRequests(msgspec.Struct, tag="add"):
    """All children of one prompt; answered by one ``AddResult`` (all are accepted or none)."""

    parent_id: str
    requests: list[WireRequest]


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


InputMessage = AddRequests | AbortRequests | Shutdown


# ---- core -> front end ----
class Ready(msgspec.Struct, tag="ready"):
    """The core loaded its model: context length and KV pool (``num_blocks`` of ``block_size`` tokens),
    and its kernel path (``kernel_backend``, ``kernel_message``: the start-up line; ``tandem/kernels/registry.py``).

    A networked core (``core_service``) also names its model (the folder's name) and vocabulary size,
    so a front end can check that its tokenizer belongs to the same model, and its process id and
    host name (``pid``, ``host``: for operators, in ``/load``; 0 / "" from older cores).
    """

    max_model_len: int
    num_blocks: int
    block_size: int = 0
    model: str = ""
    vocab_size: int = 0
    kernel_backend: str = "torch"
    kernel_message: str = ""
    kv_events_endpoint: str = ""  # where the core publishes KV events ("" = it does not; kv_cache/events.py)
    kv_events_replay_endpoint: str = ""
    kv_events_topic: str = ""
    pid: int = 0
    host: str = ""


class AddResult(msgspec.Struct, tag="add_result"):
    """``status`` 200 accepted, 400 the request can never run, 429 the waiting queue is full.

    ``code``: a machine-readable reason ("duplicate_request_id", "context_length_exceeded") or "".
    """

    parent_id: str
    status: int
    message: str = ""
    code: str = ""


class CoreStats(msgspec.Struct):
    """Decoded view of ``SchedulerStats`` (unknown fields are ignored, so the core may add more)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)
    kv_transfer: dict[str, float] = msgspec.field(default_factory=dict)


class StepOutputs(msgspec.Struct, tag="outputs"):
    """New tokens of one step (empty after handling only adds/aborts) and a stats snapshot.

    ``num_batched_tokens``: tokens computed by the step (prompt chunks + decodes), 0 without a step.
    ``queue_times``: seconds from arrival to first scheduling, for requests first scheduled now.
    """

    outputs: list[EngineCoreOutput]
    stats: CoreStats
    num_batched_tokens: int = 0
    queue_times: dict[str, float] = msgspec.field(default_factory=dict)
    kv_events: KVEventBatch | None = None  # the step's prefix-cache events, when the core records them


class CoreFailed(msgspec.Struct, tag="failed"):
    message: str


class StepFailed(msgspec.Struct, tag="step_failed"):
    """A step raised and was rolled back (``EngineStepError``), or the engine ended these requests with
    an error (``EngineCore.take_failed_requests``): they were aborted; the core keeps serving the
    others. ``message``: the cause's type and text, or why."""

    request_ids: list[str]
    message: str
    status: int = 500  # the HTTP status (400: a grammar failed; 503: a KV transfer failed, "fail" policy)


OutputMessage = Ready | AddResult | StepOutputs | CoreFailed | StepFailed


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()
