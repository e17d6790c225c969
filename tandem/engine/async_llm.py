"""AsyncLLM: the server's client of the engine-core process, and the edge HTTP handlers talk to.

Tokenization and chat templates run in one tokenizer thread, detokenization (``OutputProcessor``)
in one detokenizer thread with its own tokenizer copy: the event loop only moves messages. The core
process only sees token ids. Each accepted prompt has a one-slot ``OutputCollector`` filled by one
background task that reads the core's output socket (``output_loop.py``). When the core dies, every in-flight request
gets ``EngineDeadError`` at once and ``CoreSupervisor`` restarts the core (or, in a crash loop, the
server answers 503 for good).

Bounds: prompts admitted but not yet queued in the core (being tokenized, or on their way) count
with the core's waiting queue against ``max_queue_len``; beyond it a request gets 429.
"""

from __future__ import annotations

import asyncio
import copy
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

from tandem.config import EngineConfig
from tandem.engine.core_client import EngineCoreClient
from tandem.engine.core_messages import CoreStats
from tandem.engine.loading import Frontend, load_chat_template, load_frontend
from tandem.engine.output_loop import QUEUE_FULL_RETRY_AFTER_S, OutputLoopMixin
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.request_log import EngineMetrics, RequestLog
from tandem.engine.request_stream import ChildState, OutputCollector, PromptState, RequestStream
from tandem.engine.supervisor import CoreSupervisor, CrashLoopGuard
from tandem.errors import DuplicateRequestError, EngineDeadError, EngineRequestError
from tandem.kv_cache.events import KVEventBatch
from tandem.models.resolve import resolve_model_path
from tandem.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "EngineDeadError", "EngineRequestError", "RequestStream"]

T = TypeVar("T")


class AsyncLLM(OutputLoopMixin):
    """Serves prompts through an engine core running in another process.

    Args:
        frontend: tokenizer, config and defaults of the model (``load_frontend``).
        client: a started, ready ``EngineCoreClient``.
        metrics: receives timings and counters (optional).
        log_requests: include prompt text and parameters in the request log.
        max_queue_len: bound on waiting engine requests (the core's queue plus those admitted here and
            not yet queued); 0 = unbounded.
        start_core: starts a replacement core (blocking); None = a dead core is not restarted.
        guard: the crash-loop rule for restarts (default: 3 deaths within 60 s end them).
        instance_id: this server's id in ``/load`` and the metrics (default: a random uuid).
        supervisor_cls: ``CoreSupervisor`` (restarts a local core) or ``RemoteCoreSupervisor``
            (reconnects to a core served by ``tandem engine``; ``start_core`` then reconnects).
    """

    def __init__(
        self, frontend: Frontend, client: EngineCoreClient, metrics: EngineMetrics | None = None,
        log_requests: bool = False, max_queue_len: int = 0,
        start_core: Callable[[], EngineCoreClient] | None = None, guard: CrashLoopGuard | None = None,
        instance_id: str | None = None, supervisor_cls: type[CoreSupervisor] = CoreSupervisor,
    ) -> None:
        self.frontend = frontend
        self.tokenizer = frontend.tokenizer
        self.max_model_len = client.max_model_len
        self.block_size = getattr(client, "block_size", 0)
        self.processor = frontend.make_processor(client.max_model_len)
        # NOTE: the detokenizer thread gets its own tokenizer: a HF fast tokenizer used from two threads at
        # once can fail with "Already borrowed" (encoding may reset its truncation state).
        self.output_processor = OutputProcessor(copy.deepcopy(frontend.tokenizer))
        self.log = RequestLog(log_requests, metrics)
        self.max_queue_len = max_queue_len
        self.instance_id = instance_id or uuid.uuid4().hex
        # NOTE: one thread each, as in vLLM: tokenizing a long prompt takes seconds and must not hold the
        # event loop (HF tokenizers release the GIL); one worker keeps calls serial and in order.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tandem-tokenizer")
        self._detok_thread = ThreadPoolExecutor(1, thread_name_prefix="tandem-detokenizer")
        self.supervisor = supervisor_cls(client, start_core, guard or CrashLoopGuard(), self._fail_in_flight,
                                         self._start_output_loop, self._record_restart)
        self.last_stats = CoreStats()
        self._parents: dict[str, PromptState] = {}
        self._children: dict[str, ChildState] = {}
        self._loop_task: asyncio.Task | None = None
        self._num_admitted = 0  # engine requests admitted by handlers and not yet answered by the core
        self._num_tokenizer_jobs = 0
        self._shut_down: EngineDeadError | None = None
        # Observers for a data-parallel edge (``dp_llm.py``): each step's KV events, and the core's loss.
        self.on_kv_events: Callable[[KVEventBatch], None] | None = None
        self.on_core_lost: Callable[[], None] | None = None

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
        model_dir = resolve_model_path(config.model.model)
        # NOTE: the core process loads torch and the weights while this one loads the tokenizer.
        client = EngineCoreClient.start(model_dir, config, log_level)
        try:
            frontend = load_frontend(config)
            client.wait_ready()
        except BaseException:
            client.close()
            raise
        return cls(frontend, client, metrics, log_requests, config.scheduler.max_queue_len,
                   start_core=lambda: EngineCoreClient.launch(model_dir, config, log_level))

    async def start(self) -> None:
        """Starts watching the core and reading its outputs on the running loop (call once)."""
        self.supervisor.watch()
        self._start_output_loop(self.client)

    @property
    def metrics(self) -> EngineMetrics | None:
        """Where timings and counters go (settable once the server has built its metrics)."""
        return self.log.metrics

    @metrics.setter
    def metrics(self, metrics: EngineMetrics | None) -> None:
        self.log.metrics = metrics

    # ---- the edge: what HTTP handlers use ----
    @property
    def client(self) -> EngineCoreClient:
        """The engine core serving now (a new one after each restart)."""
        return self.supervisor.client

    @property
    def dead(self) -> EngineDeadError | None:
        """Why new requests are refused now (503), or None while the engine serves."""
        return self._shut_down or self.supervisor.unavailable

    @property
    def is_healthy(self) -> bool:
        return self.dead is None and self.client.is_alive()

    def check_available(self) -> None:
        """Raises: EngineDeadError (503) while the core is down, restarting, or shutting down."""
        if self.dead is not None:
            raise self.dead
        if not self.client.is_alive():
            raise EngineDeadError("the engine core is not running", 1.0)

    @property
    def default_sampling_params(self) -> SamplingParams:
        """The model's defaults (generation_config.json) that request fields override."""
        return self.frontend.default_sampling_params

    @property
    def model_dir(self) -> str:
        return str(self.frontend.model_dir)

    @property
    def vocab_size(self) -> int:
        return self.frontend.hf_config.vocab_size

    def load(self) -> dict[str, Any]:
        """Machine-readable load for routers: engine requests running and waiting (the core's queue plus
        those admitted here), KV cache usage (0..1), block size (tokens), this server's instance id, and
        where the core publishes KV events (``kv_events``: endpoint, replay_endpoint, topic; None: it
        does not), and ``restarts``: how often its core was restarted (a restarted core's prefix cache is
        empty: a router that indexes it starts over)."""
        stats = self.last_stats
        return {"instance_id": self.instance_id, "running": stats.num_running,
                "waiting": stats.num_waiting + self._num_admitted, "kv_cache_usage": stats.kv_cache_usage,
                "block_size": self.block_size, "num_kv_blocks": getattr(self.client, "num_blocks", 0),
                "max_queue_len": self.max_queue_len, "healthy": self.is_healthy,
                "kv_events": getattr(self.client, "kv_events", None), "restarts": self.supervisor.num_restarts}

    @contextmanager
    def admitted(self, num_requests: int) -> Iterator[None]:
        """Counts ``num_requests`` engine requests against ``max_queue_len`` while a handler tokenizes
        and queues them (the core's own check then takes over).

        Raises:
            EngineRequestError: 429 (``retry_after`` 1 s) when the waiting room is full.
            EngineDeadError: 503 while the core is unavailable.
        """
        self.check_available()
        waiting = self.last_stats.num_waiting + self._num_admitted
        if self.max_queue_len and waiting + num_requests > self.max_queue_len:
            raise EngineRequestError(
                429, f"the waiting queue is full ({self.max_queue_len} requests); retry later",
                QUEUE_FULL_RETRY_AFTER_S)
        self._num_admitted += num_requests
        try:
            yield
        finally:
            self._num_admitted -= num_requests

    async def run_in_tokenizer(self, fn: Callable[..., T], *args: object) -> T:
        """Runs ``fn(*args)`` (tokenizing, chat templating, decoding) in the tokenizer thread.

        Raises:
            EngineRequestError: 429 when ``max_queue_len`` jobs are already queued for that thread.
        """
        if self.max_queue_len and self._num_tokenizer_jobs >= self.max_queue_len:
            raise EngineRequestError(429, f"the tokenizer queue is full ({self.max_queue_len} jobs); retry later",
                                     QUEUE_FULL_RETRY_AFTER_S)
        self._num_tokenizer_jobs += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)
        finally:
            self._num_tokenizer_jobs -= 1

    # NOTE: the four methods below block (tokenizers, Jinja): call them through run_in_tokenizer.
    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a completions prompt. Raises: PromptError."""
        return self.processor.tokenize(prompt)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
        """The templated chat prompt (``tools`` and ``template_kwargs`` handed to the template) and its
        token ids. Raises: PromptError (template, empty, too long)."""
        text = self.processor.apply_chat_template(messages, add_generation_prompt, tools=tools,
                                                  template_kwargs=template_kwargs)
        return text, self.processor.chat_prompt_ids(text)

    def count_tokens(self, text_or_messages: str | list[dict[str, str]], add_special_tokens: bool = True,
                     add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids for ``/tokenize`` (no length limit; messages rendered as ``render_chat`` does).
        Raises: PromptError (chat template)."""
        if isinstance(text_or_messages, list):
            text = self.processor.apply_chat_template(text_or_messages, add_generation_prompt,
                                                      template_kwargs=template_kwargs)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(text_or_messages, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    # ---- requests ----
    async def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
        output_kind: str = "delta", arrival_time: float | None = None, on_end: Callable[[], None] | None = None,
    ) -> RequestStream:
        """Sends one prompt (``params.n`` engine requests) to the core and waits for it to be queued.

        ``output_kind``: "delta" (new text per output, for streams) or "cumulative".
        ``arrival_time``: ``time.monotonic()`` when the request arrived (TTFT and e2e start there;
        default: now). ``on_end``: see ``RequestStream`` (not called when this raises).

        Raises:
            DuplicateRequestError: ``request_id`` is in flight already.
            PromptError: the prompt does not fit the context (checked here, before sending).
            EngineRequestError: the core refused it (400 can never fit the KV cache, 429 queue full).
            EngineDeadError: the core is not serving.
        """
        self.check_available()
        if request_id in self._parents:
            raise DuplicateRequestError(request_id, f"request id {request_id!r} is already in use")
        requests = self.processor.make_requests(request_id, prompt_token_ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        state = PromptState(request_id, prompt, prompt_token_ids, params, output_kind,
                            [r.request_id for r in requests], arrival, asyncio.get_running_loop().create_future(),
                            OutputCollector(delta=output_kind == "delta"))
        for r in requests:
            r.arrival_time = arrival
        self.log.received(state)
        self._parents[request_id] = state
        try:
            self.client.add_requests(request_id, requests)
            await state.accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # NOTE: sent and maybe queued: the core must drop it; counted as aborted
            raise
        except BaseException:
            self._drop(state)  # NOTE: not sent (encoding failed, queue full), refused, or the core died
            raise
        return RequestStream(state, self.abort, on_end)

    async def generate(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
        output_kind: str = "delta",
    ) -> AsyncIterator[Any]:
        """``add_request`` then its outputs; leaving the loop early aborts the request."""
        stream = await self.add_request(request_id, prompt, prompt_token_ids, params, output_kind)
        async for out in stream:
            yield out

    def abort(self, request_id: str) -> None:
        """Aborts an unfinished prompt: the core frees its KV blocks (the abort is never lost, see
        ``EngineCoreClient.abort_requests``); each unfinished child is logged and counted as vLLM does."""
        state = self._parents.get(request_id)
        if state is None or state.done:
            return
        if self.dead is None:
            self.client.abort_requests(state.live_child_ids)
        self._drop(state)
        self.log.aborted(state)

    def _drop(self, state: PromptState) -> None:
        state.done = True
        self._parents.pop(state.request_id, None)
        for cid in state.child_ids:
            self._children.pop(cid, None)
        self._detok_thread.submit(self.output_processor.abort_request, state.request_id)

    # ---- death and shutdown ----
    def _record_restart(self) -> None:
        if self.metrics is not None:
            self.metrics.record_core_restart()

    def _fail_in_flight(self, error: EngineDeadError) -> None:
        """Fails every waiting caller with ``error`` (no one hangs); the in-flight prompts are logged
        and counted as aborted, the core's gauges are zeroed and the output loop stops."""
        if self._loop_task is not None and self._loop_task is not asyncio.current_task():
            self._loop_task.cancel()
        self.last_stats = CoreStats()
        if self.on_core_lost is not None:
            self.on_core_lost()
        if self.metrics is not None:
            self.metrics.clear_gauges()
        for state in list(self._parents.values()):
            if not state.accepted.done():
                state.accepted.set_exception(error)
            state.collector.put(error)
            self._drop(state)
            self.log.aborted(state)
        self._children.clear()

    def end_all(self, reason: str) -> int:
        """Ends every in-flight request with ``EngineDeadError(reason)`` (streams send an error event
        and ``[DONE]``, others get 503) and refuses new ones; the core drops their work. Used when the
        shutdown timeout expires. Returns the number of prompts ended."""
        live = [cid for state in self._parents.values() for cid in state.live_child_ids]
        count = len(self._parents)
        if self.dead is None and self.client.is_alive():
            self.client.abort_requests(live)
        self._shut_down = EngineDeadError(reason)
        self._fail_in_flight(self._shut_down)
        return count

    async def shutdown(self) -> None:
        """Stops the output loop and the core process (waits for it to exit, then kills it)."""
        self._shut_down = self._shut_down or EngineDeadError("the server is shutting down")
        self._fail_in_flight(self._shut_down)
        if self._loop_task is not None:
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        self._detok_thread.shutdown(wait=False, cancel_futures=True)
        await self.supervisor.close()
