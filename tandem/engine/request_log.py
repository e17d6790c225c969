"""Per-request bookkeeping of the server front end: the request log lines and the metrics.

Times are ``time.monotonic()`` seconds from the request's arrival (when the HTTP handler got it):
TTFT to its first token, ITL between token arrivals, e2e to its finish, as vLLM measures them.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from tandem.engine.core_proc import CoreStats, StepOutputs
from tandem.engine.request_stream import ChildState, PromptState
from tandem.outputs import EngineCoreOutput, RequestOutput

request_logger = logging.getLogger("tandem.requests")


class EngineMetrics(Protocol):
    """What AsyncLLM reports (implemented by ``tandem.server.metrics.ServerMetrics``). Times in s."""

    def record_step(self, stats: CoreStats, num_batched_tokens: int) -> None: ...
    def record_queue_time(self, seconds: float) -> None: ...
    def record_first_token(self, ttft: float, num_prompt_tokens: int) -> None: ...
    def record_tokens(self, num_tokens: int, itl: float | None) -> None: ...
    def record_finished(self, finish_reason: str, e2e: float) -> None: ...
    def record_core_restart(self) -> None: ...
    def clear_gauges(self) -> None: ...


class RequestLog:
    """Writes the ``tandem.requests`` log and feeds ``metrics`` (optional) for each request event.

    Args:
        log_prompts: include prompt text, token ids and parameters in the "received" line.
        metrics: receives the timings and counters, or None.
    """

    def __init__(self, log_prompts: bool, metrics: EngineMetrics | None) -> None:
        self.log_prompts = log_prompts
        self.metrics = metrics

    def received(self, state: PromptState) -> None:
        if self.log_prompts:
            request_logger.info("received request %s: prompt=%r prompt_token_ids=%s params=%s",
                                state.request_id, state.prompt, state.prompt_token_ids, state.params)

    def step(self, message: StepOutputs) -> None:
        if self.metrics is not None:
            self.metrics.record_step(message.stats, message.num_batched_tokens)
            for seconds in message.queue_times.values():
                self.metrics.record_queue_time(seconds)

    def tokens(self, child: ChildState, out: EngineCoreOutput, now: float) -> None:
        """Counts the new tokens of one child (TTFT on its first). Changes: token counts and times."""
        if not out.new_token_ids:
            return
        state = child.parent
        state.num_output_tokens += len(out.new_token_ids)
        if self.metrics is not None:
            if child.last_token_time is None:
                self.metrics.record_first_token(now - state.arrival, len(state.prompt_token_ids))
            itl = None if child.last_token_time is None else now - child.last_token_time
            self.metrics.record_tokens(len(out.new_token_ids), itl)
        if state.first_token_time is None:
            state.first_token_time = now
        child.last_token_time = now

    def finished_children(self, state: PromptState, request_output: RequestOutput, now: float) -> list[str]:
        """Records the children that finished in this output; returns their engine request ids."""
        ended = []
        for completion in request_output.outputs:
            reason = completion.finish_reason
            if reason is None or completion.index in state.finish_reasons:
                continue
            state.finish_reasons[completion.index] = reason
            ended.append(state.child_ids[completion.index])
            if self.metrics is not None:
                self.metrics.record_finished(reason, now - state.arrival)
        return ended

    def aborted(self, state: PromptState) -> None:
        """Marks the unfinished children "abort", counts them (``request_success{finished_reason="abort"}``
        and e2e latency, as vLLM does) and logs the prompt's finished line."""
        e2e = time.monotonic() - state.arrival
        for i in range(len(state.child_ids)):
            if i not in state.finish_reasons:
                state.finish_reasons[i] = "abort"
                if self.metrics is not None:
                    self.metrics.record_finished("abort", e2e)
        self.finished(state)

    def finished(self, state: PromptState) -> None:
        now = time.monotonic()
        ttft = "-" if state.first_token_time is None else f"{state.first_token_time - state.arrival:.3f}s"
        reasons = ",".join(state.finish_reasons[i] for i in sorted(state.finish_reasons))
        request_logger.info(
            "finished request %s: prompt_tokens=%d output_tokens=%d ttft=%s total=%.3fs finish_reason=%s",
            state.request_id, len(state.prompt_token_ids), state.num_output_tokens, ttft,
            now - state.arrival, reasons,
        )
