"""The server's edge over N engine cores (``tandem serve --data-parallel-size N``).

``DataParallelLLM`` has the public methods of ``AsyncLLM`` that the HTTP handlers use, over one
``AsyncLLM`` per engine core (each with its own supervisor, output loop and detokenizer thread; the
tokenizer thread of engine 0 serves them all). Each prompt goes to one engine, chosen by a router
policy (``tandem/router/policy.py``: kv-aware by default) from each engine's ``EventBlockIndex``
(fed by the KV events the core sends with its step outputs, exactly and in order) and the
outstanding tokens dispatched to it. The request's stream is that engine's, so its abort goes to
that engine. A dead engine is left out until its supervisor has restarted it (its index is cleared:
the new core starts with an empty cache); a request refused by a full engine (429) or one that died
while accepting it is tried on the next one. A prompt whose engine core dies later, before any of its
output can have reached the client, is re-dispatched once to another engine (``dp_stream.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, TypeVar

from tandem.engine.async_llm import AsyncLLM
from tandem.engine.dp_stream import Dispatch, DispatchedStream
from tandem.engine.request_stream import RequestStream
from tandem.errors import DuplicateRequestError, EngineDeadError, EngineRequestError
from tandem.kv_cache.events import KVEventBatch
from tandem.kv_cache.hashing import hash_token_blocks
from tandem.router.kv_index import EventBlockIndex
from tandem.router.policy import AllBackendsFullError, BackendState, NoHealthyBackendError, Policy
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
QUEUE_FULL_RETRY_AFTER_S = 1.0
NO_ENGINE_RETRY_AFTER_S = 2.0


class DataParallelLLM:
    """N engine cores behind one edge. Use from the event loop.

    Args:
        engines: one ready ``AsyncLLM`` per engine core (same model), in rank order.
        policy: picks the engine of each prompt (``router.policy.make_policy``).
        instance_id: this server's id in ``/load``.
    """

    def __init__(self, engines: list[AsyncLLM], policy: Policy, instance_id: str) -> None:
        if not engines:
            raise ValueError("DataParallelLLM needs at least one engine")
        self.engines = engines
        self.policy = policy
        self.instance_id = instance_id
        self.backends = [BackendState(name=str(rank), index=EventBlockIndex()) for rank in range(len(engines))]
        self._next_seq = [0] * len(engines)  # in-band KV event batches are lossless: counted here
        self._live: set[str] = set()
        self._num_admitted = 0
        self._shut_down: EngineDeadError | None = None
        for rank, engine in enumerate(engines):
            engine.on_kv_events = partial(self._on_kv_events, rank)
            engine.on_core_lost = partial(self._on_core_lost, rank)

    # ---- engine 0 answers what does not depend on an engine ----
    @property
    def first(self) -> AsyncLLM:
        return self.engines[0]

    @property
    def client(self) -> Any:
        """Engine 0's core client (its kernel path for ``/version``; every engine runs the same build)."""
        return self.first.client

    tokenizer = property(lambda self: self.first.tokenizer)
    frontend = property(lambda self: self.first.frontend)
    default_sampling_params = property(lambda self: self.first.default_sampling_params)
    model_dir = property(lambda self: self.first.model_dir)
    vocab_size = property(lambda self: self.first.vocab_size)
    block_size = property(lambda self: self.first.block_size)

    @property
    def max_model_len(self) -> int:
        return min(e.max_model_len for e in self.engines)

    @property
    def max_queue_len(self) -> int:
        """One engine's waiting-queue bound (a request goes to one engine, so this is what it can get)."""
        return self.first.max_queue_len

    async def run_in_tokenizer(self, fn: Callable[..., T], *args: object) -> T:
        return await self.first.run_in_tokenizer(fn, *args)

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        return self.first.tokenize(prompt)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
        return self.first.render_chat(messages, add_generation_prompt, tools, template_kwargs)

    def count_tokens(self, text_or_messages: str | list[dict[str, str]], add_special_tokens: bool = True,
                     add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> list[int]:
        return self.first.count_tokens(text_or_messages, add_special_tokens, add_generation_prompt, template_kwargs)

    def decode(self, token_ids: list[int]) -> str:
        return self.first.decode(token_ids)

    # ---- availability and load ----
    def _serving(self) -> list[int]:
        """Ranks whose core serves now (refreshes each backend's ``healthy``)."""
        for backend, engine in zip(self.backends, self.engines, strict=True):
            backend.healthy = engine.is_healthy
        return [rank for rank, b in enumerate(self.backends) if b.healthy]

    @property
    def dead(self) -> EngineDeadError | None:
        """Why new requests are refused (503): shutting down, or no engine core serves."""
        if self._shut_down is not None:
            return self._shut_down
        if self._serving():
            return None
        errors = [e.dead for e in self.engines if e.dead is not None]
        return errors[0] if errors else EngineDeadError("no engine core is running", NO_ENGINE_RETRY_AFTER_S)

    @property
    def is_healthy(self) -> bool:
        return self.dead is None

    def check_available(self) -> None:
        """Raises: EngineDeadError (503) while no engine core serves, or shutting down."""
        if self.dead is not None:
            raise self.dead

    def load(self) -> dict[str, Any]:
        """``AsyncLLM.load``'s keys summed over the serving engines, plus ``engines``: each engine's own
        load with its rank, core pid and host (as the core reported them: a remote core's pid is on
        its host), restarts and the router's outstanding requests / tokens for it."""
        per_engine = []
        for rank, (engine, backend) in enumerate(zip(self.engines, self.backends, strict=True)):
            client = engine.client
            per_engine.append({**engine.load(), "engine": rank, "pid": client.core_pid or client.pid,
                               "host": client.core_host,
                               "restarts": engine.supervisor.num_restarts,
                               "outstanding_requests": backend.outstanding_requests,
                               "outstanding_tokens": backend.outstanding_tokens})
        serving = [d for d in per_engine if d["healthy"]]
        return {"instance_id": self.instance_id, "running": sum(d["running"] for d in serving),
                "waiting": sum(d["waiting"] for d in serving) + self._num_admitted,
                "kv_cache_usage": sum(d["kv_cache_usage"] for d in serving) / max(1, len(serving)),
                "block_size": self.block_size, "num_kv_blocks": sum(d["num_kv_blocks"] for d in serving),
                "max_queue_len": self.max_queue_len * len(self.engines), "healthy": self.is_healthy,
                "kv_events": None, "data_parallel_size": len(self.engines), "engines": per_engine}

    @contextmanager
    def admitted(self, num_requests: int) -> Iterator[None]:
        """Counts ``num_requests`` engine requests against the serving engines' waiting room while a
        handler tokenizes and queues them (each engine's own check then takes over).

        Raises:
            EngineRequestError: 429 (``retry_after`` 1 s) when the waiting room is full.
            EngineDeadError: 503 while no engine serves.
        """
        self.check_available()
        serving = self._serving()
        waiting = sum(self.engines[r].load()["waiting"] for r in serving) + self._num_admitted
        limit = self.max_queue_len * len(serving)
        if self.max_queue_len and waiting + num_requests > limit:
            raise EngineRequestError(429, f"the waiting queues are full ({limit} requests); retry later",
                                     QUEUE_FULL_RETRY_AFTER_S)
        self._num_admitted += num_requests
        try:
            yield
        finally:
            self._num_admitted -= num_requests

    # ---- requests ----
    async def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
        output_kind: str = "delta", arrival_time: float | None = None,
    ) -> DispatchedStream:
        """Sends one prompt to the engine the policy picks (``AsyncLLM.add_request``); on a 429 from a
        full engine, or the engine's death before it accepted the prompt, the next choice is tried. The
        stream re-dispatches the prompt once if its engine core dies before any output reached the client
        (once in all: a prompt moved off an engine that died while accepting it is not moved again).

        Raises:
            DuplicateRequestError: ``request_id`` is in flight already.
            PromptError, EngineRequestError: see ``AsyncLLM.add_request`` (429 once every engine is full).
            EngineDeadError: no engine core serves.
        """
        self.check_available()
        if request_id in self._live:
            raise DuplicateRequestError(request_id, f"request id {request_id!r} is already in use")
        job = Dispatch(request_id, prompt, prompt_token_ids, params, output_kind,
                       time.monotonic() if arrival_time is None else arrival_time,
                       hash_token_blocks(prompt_token_ids, self.block_size) if self.block_size else [],
                       (len(prompt_token_ids) + (params.max_tokens or 0)) * params.n)
        self._live.add(request_id)
        try:
            rank, stream, left = await self._dispatch(job, (), None)
        except BaseException:
            self._live.discard(request_id)
            raise
        return DispatchedStream(self, job, rank, stream, moved=left is not None)

    async def _dispatch(self, job: Dispatch, exclude: Sequence[BackendState], last: Exception | None,
                        left: int | None = None) -> tuple[int, RequestStream, int | None]:
        """Sends ``job`` to the policy's choice among the engines not in ``exclude``, trying the next one
        while an engine answers 429 or dies before accepting it. Returns (rank, the engine's stream, the
        rank of the dead engine it was moved away from, or None); a move (``left``: one already made by the
        caller) is counted in ``tandem:request_redispatches_total`` once an engine accepts the prompt.
        The router's counters hold the prompt until that stream ends. Raises: see ``add_request``
        (``last`` when no engine is left to try and it is set)."""
        tried = list(exclude)
        while True:
            self._serving()
            backend = self._choose(job.block_hashes, tried, last)
            ticket = self.policy.on_dispatch(backend, job.block_hashes, job.num_tokens)
            rank = int(backend.name)
            try:
                stream = await self.engines[rank].add_request(
                    job.request_id, job.prompt, job.prompt_token_ids, job.params, job.output_kind, job.arrival_time,
                    on_end=partial(self.policy.on_complete, ticket))
            except (EngineDeadError, EngineRequestError) as e:
                self.policy.on_complete(ticket)
                if isinstance(e, EngineRequestError) and e.status != 429:
                    raise
                last = e  # NOTE: this engine is full or died before accepting: try the next one
                left = rank if left is None and isinstance(e, EngineDeadError) else left
            except BaseException:
                self.policy.on_complete(ticket)
                raise
            else:
                if left is not None:
                    logger.warning("request %s: engine core %d died before any output was sent; re-dispatched to "
                                   "engine %d", job.request_id, left, rank)
                    if self.metrics is not None:
                        self.metrics.record_redispatch(left)
                return rank, stream, left
            tried.append(backend)

    def _choose(self, hashes: list[int], tried: list[BackendState], last: Exception | None) -> BackendState:
        try:
            return self.policy.choose(hashes, self.backends, exclude=tried)
        except NoHealthyBackendError:
            raise (last if isinstance(last, EngineDeadError) else self.dead or EngineDeadError(
                "no engine core is serving", NO_ENGINE_RETRY_AFTER_S)) from None
        except AllBackendsFullError:
            if last is not None:
                raise last from None
            raise EngineRequestError(429, "every engine core is busy; retry later", QUEUE_FULL_RETRY_AFTER_S) from None

    def _release(self, request_id: str) -> None:
        self._live.discard(request_id)

    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams, output_kind: str = "delta"):
        stream = await self.add_request(request_id, prompt, prompt_token_ids, params, output_kind)
        async for out in stream:
            yield out

    # ---- KV events and core deaths ----
    def _on_kv_events(self, rank: int, batch: KVEventBatch) -> None:
        seq, self._next_seq[rank] = self._next_seq[rank], self._next_seq[rank] + 1
        self.backends[rank].index.apply(seq, batch)

    def _on_core_lost(self, rank: int) -> None:
        """The core's cache is gone with it: its index restarts empty (a restarted core starts cold)."""
        index = self.backends[rank].index
        index.clear()
        index.next_seq = None
        self._next_seq[rank] = 0

    # ---- lifecycle ----
    @property
    def metrics(self) -> Any:
        return getattr(self, "_metrics", None)

    @metrics.setter
    def metrics(self, metrics: Any) -> None:
        """A ``DataParallelMetrics``: each engine reports into its own labelled part."""
        self._metrics = metrics
        for engine, part in zip(self.engines, metrics.engines, strict=True):
            engine.metrics = part

    async def start(self) -> None:
        for engine in self.engines:
            await engine.start()

    def end_all(self, reason: str) -> int:
        self._shut_down = EngineDeadError(reason)
        return sum(engine.end_all(reason) for engine in self.engines)

    async def shutdown(self) -> None:
        self._shut_down = self._shut_down or EngineDeadError("the server is shutting down")
        await asyncio.gather(*(engine.shutdown() for engine in self.engines))


