"""The front end's output loop: one task per core reading its output socket (``AsyncLLM`` inherits it).

Step outputs go to the detokenizer thread (``OutputProcessor``) and then to each prompt's one-slot
``OutputCollector``; an ``AddResult`` accepts or refuses a prompt (its children enter the output
processor only once accepted); a ``StepFailed`` ends the prompts of a rolled-back step; a
``CoreFailed``, or a bug here, hands the core to the supervisor as dead, so no one is left waiting.
The state (``_parents``, ``_children``, ``log``, ``supervisor``, ...) is ``AsyncLLM``'s own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from tandem.engine.core_messages import AddResult, CoreFailed, CoreStats, StepFailed, StepOutputs
from tandem.engine.request_stream import ChildState, PromptState
from tandem.errors import DuplicateRequestError, EngineRequestError
from tandem.kv_cache.events import KVEventBatch

if TYPE_CHECKING:
    from tandem.engine.core_client import EngineCoreClient
    from tandem.engine.output_processor import OutputProcessor
    from tandem.engine.request_log import RequestLog
    from tandem.engine.supervisor import CoreSupervisor

logger = logging.getLogger("tandem.engine.async_llm")  # NOTE: the name it always logged under
QUEUE_FULL_RETRY_AFTER_S = 1.0


class OutputLoopMixin:
    """``AsyncLLM``'s output loop and the handlers of the core's three kinds of message."""

    max_model_len: int
    output_processor: OutputProcessor
    log: RequestLog
    supervisor: CoreSupervisor
    last_stats: CoreStats
    on_kv_events: Callable[[KVEventBatch], None] | None
    _parents: dict[str, PromptState]
    _children: dict[str, ChildState]
    _loop_task: asyncio.Task | None
    _detok_thread: ThreadPoolExecutor

    if TYPE_CHECKING:
        @property
        def client(self) -> EngineCoreClient: ...
        def _drop(self, state: PromptState) -> None: ...

    def _start_output_loop(self, client: EngineCoreClient) -> None:
        self.max_model_len = client.max_model_len
        self._loop_task = asyncio.get_running_loop().create_task(self._output_loop(client),
                                                                 name="tandem-output-loop")

    async def _output_loop(self, client: EngineCoreClient) -> None:
        try:
            while True:
                message = await client.get_output()
                if isinstance(message, StepOutputs):
                    await self._on_step(client, message)
                elif isinstance(message, AddResult):
                    self._on_add_result(message)
                elif isinstance(message, StepFailed):
                    self._on_step_failed(message)
                elif isinstance(message, CoreFailed):
                    self.supervisor.core_died(client, f"the engine core failed: {message.message.splitlines()[0]}")
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:
            # NOTE: a bug here must not leave anyone hanging: the core is treated as dead (its requests
            # fail, it is restarted), since no one reads its outputs any more.
            logger.exception("output loop failed")
            self.supervisor.core_died(client, f"the engine front end failed: {type(e).__name__}: {e}")

    def _on_add_result(self, result: AddResult) -> None:
        state = self._parents.get(result.parent_id)
        if state is None or state.accepted.done():
            return  # NOTE: the caller gave up while waiting; its abort message follows in order.
        if result.status != 200:
            error = DuplicateRequestError(result.parent_id, f"request id {result.parent_id!r} is already in use") \
                if result.code == "duplicate_request_id" \
                else EngineRequestError(result.status, result.message, QUEUE_FULL_RETRY_AFTER_S, result.code or None)
            state.accepted.set_exception(error)
            return
        n = len(state.child_ids)
        for index, child_id in enumerate(state.child_ids):
            self._children[child_id] = ChildState(state, index)
            self._detok_thread.submit(
                self.output_processor.add_request, child_id, state.request_id, index, n, state.prompt,
                state.prompt_token_ids, state.params, output_kind=state.output_kind)
        state.accepted.set_result(None)

    async def _on_step(self, client: EngineCoreClient, message: StepOutputs) -> None:
        self.last_stats = message.stats
        self.log.step(message)
        if message.kv_events is not None and self.on_kv_events is not None:
            self.on_kv_events(message.kv_events)
        now = time.monotonic()
        known = [o for o in message.outputs if o.request_id in self._children]
        for out in known:
            self.log.tokens(self._children[out.request_id], out, now)
        if not known:
            return
        processed = await asyncio.get_running_loop().run_in_executor(
            self._detok_thread, self.output_processor.process_outputs, known)
        if processed.reqs_to_abort and client is self.client:
            client.abort_requests(list(processed.reqs_to_abort))
        for request_output in processed.request_outputs:
            state = self._parents.get(request_output.request_id)
            if state is None:
                continue  # NOTE: aborted while its text was being detokenized
            for cid in self.log.finished_children(state, request_output, now):
                self._children.pop(cid, None)
            state.collector.put(request_output)
            if request_output.finished:
                state.done = True
                self._parents.pop(state.request_id, None)
                self.log.finished(state)

    def _on_step_failed(self, message: StepFailed) -> None:
        """Ends the prompts of a failed (rolled-back) step with a 500, of a failed KV transfer with a 503
        (retry elsewhere), of a failed grammar with a 400; the core serves on."""
        text = message.message.splitlines()[0]
        if message.status == 500:
            error = EngineRequestError(500, f"the engine step failed: {text}")
        else:
            retry_after = QUEUE_FULL_RETRY_AFTER_S if message.status == 503 else None
            error = EngineRequestError(message.status, text, retry_after)
        for parent_id in {self._children[c].parent.request_id for c in message.request_ids if c in self._children}:
            state = self._parents[parent_id]
            self.client.abort_requests(state.live_child_ids)  # NOTE: its other children may still run
            state.collector.put(error)
            self._drop(state)
            self.log.aborted(state)
