"""EngineCore: the step loop (schedule -> execute -> update). No I/O; the offline LLM and the
engine-core process both drive it.

The core only wires its parts: a ``Scheduler`` (queues, KV blocks), a ``ModelRunner`` (tensors) and
an optional ``KVConnector`` (KV arriving from elsewhere). It owns no module-level state, so several
engines can live in one process: each has its own KV cache and its own sampling generator.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from tandem.config import EngineConfig
from tandem.errors import EngineStepError
from tandem.kv_cache.events import EventRecorder, KVEventBatch, snapshot_batch
from tandem.kv_cache.storage import plan_num_blocks
from tandem.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from tandem.request import Request
from tandem.scheduler.scheduler import Scheduler
from tandem.scheduler.stats import SchedulerStats
from tandem.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

IDLE_CHECK_INTERVAL_S = 1.0  # at most one integrity check per second while idle


class KVConnector(Protocol):
    """Where KV computed elsewhere comes from (a P/D transfer); the engine only polls it.

    The connector writes the KV of a ``WAITING_FOR_REMOTE_KV`` request into the blocks that
    ``Scheduler.add_remote_kv_request`` returned (``ModelRunner.write_kv_blocks``), then reports
    the request id here. If the request is aborted first, its blocks stay held under the lease
    ``f"aborted-remote:{request_id}"`` until the connector releases it
    (``KVCacheManager.release``) or it expires; a late report of its id is ignored.
    """

    def ready_request_ids(self) -> list[str]:
        """Ids whose remote KV has been written since the last call (each reported once)."""
        ...


class RequestKVConnector(KVConnector, Protocol):
    """A connector that also sees requests come and go (``tandem.disagg.connector.TandemConnector``):
    it may take a new request itself (``add_request`` True), hears of aborts, annotates finished
    outputs (``kv_transfer_params``), lists requests it ended (``failed``: (id, why), drained by the
    engine) and has counters (``stats``)."""

    failed: list[tuple[str, str]]

    def add_request(self, request: Request) -> bool: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def on_outputs(self, outputs: list[EngineCoreOutput]) -> None: ...

    def stats(self) -> dict[str, float]: ...

    def close(self) -> None: ...


def build_scheduler(config: EngineConfig, runner: ModelRunner, clock: Callable[[], float] = time.monotonic
                    ) -> Scheduler:
    """Sizes the KV pool (``storage.plan_num_blocks``, target + draft caches), allocates the runner's
    cache and returns a scheduler over the same blocks.

    Changes: the runner's KV cache (allocated); may lower the speculator's ``max_model_len`` to the pool.
    Raises:
        ConfigError: the budget holds fewer than 2 blocks, or exceeds the memory check.
    """
    block_size = config.cache.block_size
    draft_bytes = runner.speculator.kv_cache_bytes_per_block() if runner.speculator is not None else 0
    num_blocks = plan_num_blocks(config.cache, runner.kv_cache_bytes_per_block(block_size), draft_bytes,
                                 config.scheduler.max_num_seqs, runner.max_model_len)
    runner.initialize_kv_cache(num_blocks)
    scheduler = Scheduler(config.scheduler, config.cache, num_blocks, runner.max_model_len,
                          config.speculative, clock=clock, sliding_window=runner.kv_window)
    if scheduler.max_model_len < runner.max_model_len:
        # NOTE: one request alone must fit in the pool, or it would preempt itself forever.
        logger.warning(
            "the KV cache holds %d tokens, fewer than the context length %d: max_model_len is "
            "lowered to %d; raise --kv-cache-gib to serve the full context",
            num_blocks * block_size, runner.max_model_len, scheduler.max_model_len,
        )
        if runner.speculator is not None:
            runner.speculator.max_model_len = scheduler.max_model_len  # no drafts past the pool
    return scheduler


class EngineCore:
    """Drives one engine instance: its scheduler, model runner and optional KV connector.

    Args:
        model_dir: a local HF-format folder (already resolved; GGUF is converted before this); may
            be None when ``runner`` is given.
        config: the engine configuration.
        progress: show a progress bar while loading weights.
        runner: a ready ``ModelRunner`` (default: loads ``model_dir``).
        scheduler: a scheduler over the runner's KV blocks (default: ``build_scheduler``).
        kv_connector: source of remote KV (``KVConnector``), or None.
        clock: monotonic clock (seconds) for the idle check's rate limit and KV lease expiry.

    Raises:
        FileNotFoundError, CheckpointError, ConfigError: the checkpoint or configuration is unusable.
    """

    def __init__(
        self, model_dir: Path | None, config: EngineConfig, progress: bool = True, *,
        runner: ModelRunner | None = None, scheduler: Scheduler | None = None,
        kv_connector: KVConnector | None = None, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        t0 = time.monotonic()
        if runner is None and model_dir is None:
            raise ValueError("EngineCore needs a model_dir or a runner")
        self.config = config
        self.runner = runner if runner is not None else ModelRunner(model_dir, config, progress=progress)
        self.scheduler = scheduler if scheduler is not None else build_scheduler(config, self.runner, clock)
        if kv_connector is None and config.kv_transfer is not None:
            from tandem.disagg.connector import TandemConnector

            kv_connector = TandemConnector(config.kv_transfer, self.runner, self.scheduler, clock)
        self.kv_connector = kv_connector
        # NOTE: only a RequestKVConnector sees requests; a plain KVConnector is only polled.
        self._request_connector = kv_connector if hasattr(kv_connector, "add_request") else None
        self.clock = clock
        self.num_blocks = self.scheduler.kv_cache_manager.num_blocks
        self.max_model_len = min(self.runner.max_model_len, self.scheduler.max_model_len)
        self._last_check = float("-inf")
        # NOTE: attached before the first step, so the recorder sees the pool's map from empty.
        self.kv_events: EventRecorder | None = None
        if config.kv_events is not None and config.kv_events.enable_kv_cache_events:
            self.kv_events = EventRecorder(self.scheduler.block_size)
            self.scheduler.kv_cache_manager.block_pool.events = self.kv_events
        logger.info(
            "engine ready in %.1f s: %d KV blocks of %d tokens (%d tokens), max_model_len %d",
            time.monotonic() - t0, self.num_blocks, self.scheduler.block_size,
            self.num_blocks * self.scheduler.block_size, self.max_model_len,
        )

    @property
    def num_steps(self) -> int:
        """Steps that ran a forward pass and were applied (cumulative)."""
        return self.scheduler.num_steps

    def add_request(self, request: Request) -> None:
        """Queues ``request`` for scheduling (changes the scheduler's waiting queue and
        ``request.block_hash_root``). A request with
        structured output starts compiling its grammar in the runner's compile thread and waits
        (``Request.ready_check``) until it is built; the scheduler skips it meanwhile.

        Raises:
            DuplicateRequestError: the id is already queued or running (``tandem.errors``).
            ContextLengthExceededError: the prompt is longer than the context.
            ValueError: the request can never fit in the KV cache.
        """
        request.block_hash_root = self.runner.block_hash_root(len(request.prompt_token_ids))
        if self._request_connector is None or not self._request_connector.add_request(request):
            self.scheduler.add_request(request)
        if request.sampling_params.structured_outputs is not None:
            request.ready_check = self.runner.prepare_grammar(
                request.request_id, request.sampling_params, request.eos_token_ids)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Stops these requests and frees their KV blocks at once; unknown ids are ignored."""
        ids = list(request_ids)
        self.scheduler.abort_requests(ids)
        self.runner.cancel_grammars(ids)  # NOTE: now: with no request left no step runs to tell the runner
        if self._request_connector is not None:
            self._request_connector.abort_requests(ids)

    def take_failed_requests(self) -> list[tuple[str, str, int]]:
        """(request id, why, HTTP status) of the requests ended since the last call that need an error
        answer: 400 for a structured-output matcher that failed while generating (a grammar beyond
        llguidance's limits), 503 for a KV transfer the connector gave up on. Changes: empties the
        scheduler's and the connector's lists."""
        failed = [(rid, why, 400) for rid, why in self.scheduler.failed]
        self.scheduler.failed = []
        if self._request_connector is not None:
            failed += [(rid, why, 503) for rid, why in self._request_connector.failed]
            self._request_connector.failed = []
        return failed

    def close(self) -> None:
        """Closes the KV connector's sockets and thread (if any)."""
        if self._request_connector is not None:
            self._request_connector.close()

    def step(self) -> list[EngineCoreOutput]:
        """Runs one engine step: schedule, one forward pass, update. Returns new tokens per request.

        With no request left it runs ``on_idle`` instead (lease expiry, a rate-limited check).
        Changes: scheduler queues and counters, KV cache contents, runner per-request state.
        Raises:
            EngineStepError: the forward pass raised; the step was rolled back first (its requests
                aborted, no block of it hashable), so the engine stays usable. A ``BaseException``
                (KeyboardInterrupt) is re-raised as is after the same rollback.
        """
        self._poll_connector()
        self.scheduler.kv_cache_manager.expire_leases()
        scheduler_output = self.scheduler.schedule()
        runner_output = self._execute(scheduler_output)
        if scheduler_output.is_empty:
            if not self.scheduler.has_unfinished_requests():
                self.on_idle()
            return []
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self._request_connector is not None:
            self._request_connector.on_outputs(outputs)
            if runner_output.failed:
                self._request_connector.abort_requests(list(runner_output.failed))
        return outputs

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        try:
            return self.runner.execute(scheduler_output)
        except BaseException as exc:
            failed = self.scheduler.abort_step(scheduler_output)
            if self._request_connector is not None:
                self._request_connector.abort_requests(failed)
            if not isinstance(exc, Exception):
                raise
            logger.exception("engine step failed; aborted %d request(s): %s", len(failed), failed)
            raise EngineStepError(failed) from exc

    def _poll_connector(self) -> None:
        if self.kv_connector is None:
            return
        for request_id in self.kv_connector.ready_request_ids():
            if request_id in self.scheduler.remote_kv_tokens:  # NOTE: not if aborted meanwhile
                self.scheduler.mark_remote_kv_ready(request_id)

    def on_idle(self) -> None:
        """Housekeeping for a loop with no work: expires KV leases and, at most once per
        ``IDLE_CHECK_INTERVAL_S`` seconds, runs ``Scheduler.check`` (which includes the KV manager's).

        Changes: frees the blocks of expired leases; the KV connector serves and applies transfers.
        Raises:
            AssertionError: the integrity check failed (a leak or a corrupted cache: a bug).
        """
        self._poll_connector()
        self.scheduler.kv_cache_manager.expire_leases()
        now = self.clock()
        if now - self._last_check < IDLE_CHECK_INTERVAL_S:
            return
        self._last_check = now
        try:
            self.scheduler.check()
        except AssertionError:
            logger.exception("engine integrity check failed")
            raise

    def take_kv_events(self, engine_id: str = "") -> KVEventBatch | None:
        """The prefix-cache events since the last call (``kv_cache/events.py``), or None when there were
        none or events are off. Changes: empties the recorder."""
        return None if self.kv_events is None else self.kv_events.take(engine_id)

    def kv_snapshot(self, engine_id: str = "") -> KVEventBatch:
        """Every hash in the prefix cache as one batch (``snapshot_batch``). Changes nothing."""
        pool = self.scheduler.kv_cache_manager.block_pool
        return snapshot_batch(pool.cached_hashes(), self.scheduler.block_size, engine_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> SchedulerStats:
        """The metrics snapshot (``SchedulerStats``, with the proposer's counters). Changes nothing."""
        speculator = self.runner.speculator
        stats = self.scheduler.make_stats(speculator.stats() if speculator is not None else None)
        if self._request_connector is not None:
            stats = dataclasses.replace(stats, kv_transfer=self._request_connector.stats())
        return stats
