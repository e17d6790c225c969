"""AsyncLLM: the server's client of the engine-core process.

Tokenization, chat templates and detokenization (``OutputProcessor``) stay in this process; the
core process only sees token ids. Each accepted prompt gets an asyncio queue of ``RequestOutput``s
filled by one background task that reads the core's output socket. When the core process dies,
every waiting caller gets ``EngineDeadError`` at once and new requests are refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from tandem.config import EngineConfig
from tandem.engine.core_client import EngineCoreClient
from tandem.engine.core_proc import AddResult, CoreFailed, CoreStats, StepOutputs
from tandem.engine.loading import Frontend, load_chat_template, load_frontend
from tandem.engine.output_processor import OutputProcessor
from tandem.models.resolve import resolve_model_path
from tandem.outputs import EngineCoreOutput, RequestOutput
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
request_logger = logging.getLogger("tandem.requests")
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine-core process is gone (killed, crashed, or shut down); the server answers 503."""


class EngineRequestError(Exception):
    """The core refused a request: ``status`` 400 (it can never run) or 429 (the queue is full)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class EngineMetrics(Protocol):
    """What AsyncLLM reports (implemented by ``tandem.server.metrics.ServerMetrics``). Times in s."""

    def record_step(self, stats: CoreStats, num_batched_tokens: int) -> None: ...
    def record_queue_time(self, seconds: float) -> None: ...
    def record_first_token(self, ttft: float, num_prompt_tokens: int) -> None: ...
    def record_tokens(self, num_tokens: int, itl: float | None) -> None: ...
    def record_finished(self, finish_reason: str, e2e: float) -> None: ...
    def clear_gauges(self) -> None: ...


@dataclass
class _Parent:
    """Front-end state of one prompt (its ``n`` children run as separate engine requests)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: str
    child_ids: list[str]
    arrival: float
    accepted: asyncio.Future
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    first_token_time: float | None = None
    num_output_tokens: int = 0
    finish_reasons: dict[int, str] = field(default_factory=dict)
    done: bool = False


@dataclass
class _Child:
    parent: _Parent
    index: int
    last_token_time: float | None = None


class RequestStream:
    """The outputs of one accepted prompt, in order; ``abort()`` (or leaving early) stops it."""

    def __init__(self, engine: AsyncLLM, state: _Parent) -> None:
        self._engine = engine
        self._state = state

    @property
    def request_id(self) -> str:
        return self._state.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._state.prompt_token_ids

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """Yields ``RequestOutput``s until one is finished.

        Raises:
            EngineDeadError: the core process died while this request was running.
        """
        try:
            while True:
                item = await self._state.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.abort()

    def abort(self) -> None:
        """Stops the request in the engine (frees its KV blocks); no-op once it has finished."""
        self._engine.abort(self._state.request_id)


class AsyncLLM:
    """Serves prompts through an engine core running in another process.

    Args:
        frontend: tokenizer, config and defaults of the model (``load_frontend``).
        client: a started ``EngineCoreClient``.
        metrics: receives timings and counters (optional).
        log_requests: include prompt text and parameters in the request log.
        max_queue_len: the core's waiting-queue bound (0 = unbounded), for requests that can never fit it.
    """

    def __init__(
        self, frontend: Frontend, client: EngineCoreClient, metrics: EngineMetrics | None = None,
        log_requests: bool = False, max_queue_len: int = 0,
    ) -> None:
        self.frontend = frontend
        self.tokenizer = frontend.tokenizer
        self.client = client
        self.max_model_len = client.max_model_len
        self.processor = frontend.make_processor(client.max_model_len)
        self.output_processor = OutputProcessor(frontend.tokenizer)
        self.metrics = metrics
        self.log_requests = log_requests
        self.max_queue_len = max_queue_len
        # NOTE: one thread, as in vLLM: tokenizing and chat templating a long prompt take seconds and
        # must not hold the event loop (HF tokenizers release the GIL); one worker keeps calls serial.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tandem-tokenizer")
        self.dead: EngineDeadError | None = None
        self.last_stats = CoreStats()
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, _Child] = {}
        self._loop_task: asyncio.Task | None = None
        self._closing = False

    @classmethod
    def from_config(
        cls, config: EngineConfig, metrics: EngineMetrics | None = None, log_requests: bool = False,
        log_level: str = "WARNING",
    ) -> AsyncLLM:
        """Loads the tokenizer here and the model in a new engine-core process (blocks until ready).

        Raises:
            FileNotFoundError / ValueError: bad model path or config.
            EngineCoreStartError: the core process failed while loading.
        """
        load_chat_template(config.model.chat_template)  # NOTE: a bad --chat-template fails before the core starts
        # NOTE: the core process loads torch and the weights while this one loads the tokenizer.
        client = EngineCoreClient.start(resolve_model_path(config.model.model), config, log_level)
        try:
            frontend = load_frontend(config)
            client.wait_ready()
        except BaseException:
            client.close()
            raise
        return cls(frontend, client, metrics, log_requests, config.scheduler.max_queue_len)

    async def start(self) -> None:
        """Starts reading the core's outputs on the running loop (call once, inside the server)."""
        self.client.attach(self._on_core_death)
        self._loop_task = asyncio.create_task(self._output_loop(), name="tandem-output-loop")

    @property
    def is_healthy(self) -> bool:
        return self.dead is None and self.client.is_alive()

    async def run_in_tokenizer(self, fn: Callable[..., T], *args: object) -> T:
        """Runs ``fn(*args)`` (tokenizing, chat templating, detokenizing) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    async def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
        output_kind: str = "delta",
    ) -> RequestStream:
        """Sends one prompt (``params.n`` engine requests) to the core and waits for it to be queued.

        ``output_kind``: "delta" (new text per output, for streams) or "cumulative".

        Raises:
            PromptError: the prompt does not fit the context (checked here, before sending).
            EngineRequestError: the core refused it (400 can never fit the KV cache, 429 queue full).
            EngineDeadError: the core process is not running.
        """
        if self.dead is not None:
            raise self.dead
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        requests = self.processor.make_requests(request_id, prompt_token_ids, params)
        loop = asyncio.get_running_loop()
        state = _Parent(request_id, prompt, prompt_token_ids, params, output_kind,
                        [r.request_id for r in requests], time.monotonic(), loop.create_future())
        for r in requests:
            r.arrival_time = state.arrival
        if self.log_requests:
            request_logger.info("received request %s: prompt=%r prompt_token_ids=%s params=%s",
                                request_id, prompt, prompt_token_ids, params)
        self._parents[request_id] = state
        try:
            self.client.add_requests(request_id, requests)
            await state.accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # NOTE: sent and maybe queued: the core must drop it; counted as aborted
            raise
        except BaseException:
            self._drop(state)  # NOTE: not sent (encoding failed), refused, or the core died: nothing to count
            raise
        return RequestStream(self, state)

    async def generate(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
        output_kind: str = "delta",
    ) -> AsyncIterator[RequestOutput]:
        """``add_request`` then its outputs; leaving the loop early aborts the request."""
        stream = await self.add_request(request_id, prompt, prompt_token_ids, params, output_kind)
        async for out in stream:
            yield out

    def abort(self, request_id: str) -> None:
        """Aborts an unfinished prompt: the core frees its KV blocks; each unfinished child is logged
        and counted (``request_success{finished_reason="abort"}``, e2e latency) as vLLM does."""
        state = self._parents.get(request_id)
        if state is None or state.done:
            return
        live = [cid for i, cid in enumerate(state.child_ids) if i not in state.finish_reasons]
        if self.dead is None:
            self.client.abort_requests(live)
        self._drop(state)
        self._finish_as_aborted(state)

    def _finish_as_aborted(self, state: _Parent) -> None:
        """Marks the unfinished children "abort", counts them in the metrics and logs the prompt."""
        e2e = time.monotonic() - state.arrival
        for i in range(len(state.child_ids)):
            if i not in state.finish_reasons:
                state.finish_reasons[i] = "abort"
                if self.metrics is not None:
                    self.metrics.record_finished("abort", e2e)
        self._log_finished(state)

    def _drop(self, state: _Parent) -> None:
        state.done = True
        self._parents.pop(state.request_id, None)
        for cid in state.child_ids:
            self._children.pop(cid, None)
        self.output_processor.abort_request(state.request_id)

    # ---- the output loop ----
    async def _output_loop(self) -> None:
        try:
            while True:
                message = await self.client.get_output()
                if isinstance(message, StepOutputs):
                    self._on_step(message)
                elif isinstance(message, AddResult):
                    self._on_add_result(message)
                elif isinstance(message, CoreFailed):
                    self._fail(EngineDeadError(f"the engine core failed: {message.message.splitlines()[0]}"))
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # NOTE: a bug here must not leave clients hanging: fail them all.
            logger.exception("output loop failed")
            self._fail(EngineDeadError(f"the engine front end failed: {e}"))

    def _on_add_result(self, result: AddResult) -> None:
        state = self._parents.get(result.parent_id)
        if state is None or state.accepted.done():
            return  # NOTE: the caller gave up while waiting; its abort message follows in order.
        if result.status != 200:
            state.accepted.set_exception(EngineRequestError(result.status, result.message))
            return
        n = len(state.child_ids)
        for index, child_id in enumerate(state.child_ids):
            self._children[child_id] = _Child(state, index)
            self.output_processor.add_request(
                child_id, state.request_id, index, n, state.prompt, state.prompt_token_ids, state.params,
                output_kind=state.output_kind,
            )
        state.accepted.set_result(None)

    def _on_step(self, message: StepOutputs) -> None:
        self.last_stats = message.stats
        if self.metrics is not None:
            self.metrics.record_step(message.stats, message.num_batched_tokens)
            for seconds in message.queue_times.values():
                self.metrics.record_queue_time(seconds)
        now = time.monotonic()
        known = [o for o in message.outputs if o.request_id in self._children]
        for out in known:
            self._record_tokens(self._children[out.request_id], out, now)
        processed = self.output_processor.process_outputs(known)
        if processed.reqs_to_abort:
            self.client.abort_requests(list(processed.reqs_to_abort))
        for request_output in processed.request_outputs:
            state = self._parents.get(request_output.request_id)
            if state is None:
                continue
            self._record_finished_children(state, request_output, now)
            state.queue.put_nowait(request_output)
            if request_output.finished:
                state.done = True
                self._parents.pop(state.request_id, None)
                self._log_finished(state)

    def _record_tokens(self, child: _Child, out: EngineCoreOutput, now: float) -> None:
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

    def _record_finished_children(self, state: _Parent, request_output: RequestOutput, now: float) -> None:
        for completion in request_output.outputs:
            reason = completion.finish_reason
            if reason is None or completion.index in state.finish_reasons:
                continue
            state.finish_reasons[completion.index] = reason
            self._children.pop(state.child_ids[completion.index], None)
            if self.metrics is not None:
                self.metrics.record_finished(reason, now - state.arrival)

    def _log_finished(self, state: _Parent) -> None:
        now = time.monotonic()
        ttft = "-" if state.first_token_time is None else f"{state.first_token_time - state.arrival:.3f}s"
        reasons = ",".join(state.finish_reasons[i] for i in sorted(state.finish_reasons))
        request_logger.info(
            "finished request %s: prompt_tokens=%d output_tokens=%d ttft=%s total=%.3fs finish_reason=%s",
            state.request_id, len(state.prompt_token_ids), state.num_output_tokens, ttft,
            now - state.arrival, reasons,
        )

    # ---- death and shutdown ----
    def _on_core_death(self) -> None:
        if self._closing:
            return
        logger.error("the engine core process (pid %s) exited with code %s",
                     self.client.pid, self.client.proc.exitcode)
        self._fail(EngineDeadError("the engine core process died"))

    def _fail(self, error: EngineDeadError) -> None:
        """Marks the engine dead and fails every waiting caller with ``error`` (no one hangs); the
        in-flight prompts are logged and counted as aborted, and the core's gauges are zeroed."""
        if self.dead is not None:
            return
        self.dead = error
        self.last_stats = CoreStats()
        if self.metrics is not None:
            self.metrics.clear_gauges()
        for state in list(self._parents.values()):
            if not state.accepted.done():
                state.accepted.set_exception(error)
            state.queue.put_nowait(error)
            self._drop(state)
            self._finish_as_aborted(state)
        self._children.clear()

    def end_all(self, reason: str) -> int:
        """Ends every in-flight request with ``EngineDeadError(reason)`` (streams send an error event
        and ``[DONE]``, others get 503) and refuses new ones; the core drops their work. Used when the
        shutdown timeout expires. Returns the number of prompts ended."""
        live = [cid for state in self._parents.values() for i, cid in enumerate(state.child_ids)
                if i not in state.finish_reasons]
        count = len(self._parents)
        if self.dead is None and self.client.is_alive():
            self.client.abort_requests(live)
        self._fail(EngineDeadError(reason))
        return count

    async def shutdown(self) -> None:
        """Stops the output loop and the core process (waits for it to exit, then kills it)."""
        self._closing = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        self._fail(EngineDeadError("the server is shutting down"))
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self.client.close)
