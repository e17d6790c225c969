"""EngineCore: the step loop (schedule -> execute -> update). No I/O; the offline LLM and the
engine-core process both drive it."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from tandem.config import EngineConfig
from tandem.kv_cache.storage import num_blocks_for_budget
from tandem.outputs import EngineCoreOutput
from tandem.request import Request
from tandem.scheduler.scheduler import Scheduler
from tandem.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """A snapshot for metrics: queue sizes, KV usage (0..1) and cumulative counters (tokens)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    # Speculative decoding (cumulative; all 0 without it): verifications, draft tokens verified and
    # accepted, accepted per draft position; the proposer's own counters (draft forwards, seconds, ...).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    spec_proposer: dict[str, float] = field(default_factory=dict)

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / verified draft tokens (0.0 before any draft)."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens per verification step: 1 + accepted drafts per step (0.0 before any draft)."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0


class EngineCore:
    """Owns the model runner, the KV cache and the scheduler of one engine instance.

    Args:
        model_dir: a local HF-format folder (already resolved; GGUF is converted before this).
        config: the engine configuration.
    """

    def __init__(self, model_dir: Path, config: EngineConfig, progress: bool = True) -> None:
        t0 = time.monotonic()
        self.config = config
        self.runner = ModelRunner(model_dir, config, progress=progress)
        hf = self.runner.hf_config
        self.max_model_len = self.runner.max_model_len
        block_size = config.cache.block_size
        if config.cache.num_blocks is not None:
            num_blocks = config.cache.num_blocks
        else:
            num_blocks = num_blocks_for_budget(
                config.cache.kv_cache_gib, block_size, hf.num_layers, hf.num_kv_heads, hf.head_dim,
                self.runner.dtype_bytes,
            )
            draft_bytes = self.runner.speculator.kv_cache_bytes_per_block() if self.runner.speculator else 0
            if draft_bytes:
                # NOTE: a draft model's cache uses the same block ids, so each block costs both caches.
                target_bytes = self.runner.kv_cache_bytes_per_block(block_size)
                num_blocks = max(2, num_blocks * target_bytes // (target_bytes + draft_bytes))
            # NOTE: more blocks than every sequence at full context (x2 for prefix-cache reuse) can
            # never be used; small models would otherwise zero-fill gigabytes for nothing.
            useful = 2 * config.scheduler.max_num_seqs * -(-self.max_model_len // block_size)
            num_blocks = min(num_blocks, max(useful, 2))
        self.num_blocks = num_blocks
        self.runner.initialize_kv_cache(num_blocks)
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks, self.max_model_len,
                                   config.speculative)
        if self.scheduler.max_model_len < self.max_model_len:
            # NOTE: one request alone must fit in the pool, or it would preempt itself forever.
            logger.warning(
                "the KV cache holds %d tokens, fewer than the context length %d: max_model_len is "
                "lowered to %d; raise --kv-cache-gib to serve the full context",
                num_blocks * block_size, self.max_model_len, self.scheduler.max_model_len,
            )
            self.max_model_len = self.scheduler.max_model_len
            if self.runner.speculator is not None:
                self.runner.speculator.max_model_len = self.max_model_len  # no drafts past the pool
        self.num_steps = 0
        logger.info(
            "engine ready in %.1f s: %d KV blocks of %d tokens (%d tokens), max_model_len %d",
            time.monotonic() - t0, num_blocks, block_size, num_blocks * block_size, self.max_model_len,
        )

    def add_request(self, request: Request) -> None:
        """Queues ``request`` for scheduling (changes the scheduler's waiting queue).

        Raises:
            ValueError: the request can never fit in the KV cache.
        """
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Stops these requests and frees their KV blocks at once; unknown ids are ignored."""
        self.scheduler.abort_requests(list(request_ids))

    def step(self) -> list[EngineCoreOutput]:
        """Runs one engine step: schedule, one forward pass, update. Returns new tokens per request.

        Changes: scheduler queues and counters, KV cache contents, runner per-request state.
        """
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute(scheduler_output)
        if scheduler_output.is_empty:
            return []
        self.num_steps += 1
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> EngineStats:
        s = self.scheduler
        kv = s.kv_cache_manager
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting, kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=s.num_preemptions_total, num_steps=self.num_steps,
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict:
        spec = self.scheduler.spec_stats
        if spec is None or self.runner.speculator is None:
            return {}
        return {
            "spec_num_drafts": spec.num_drafts, "spec_num_draft_tokens": spec.num_draft_tokens,
            "spec_num_accepted_tokens": spec.num_accepted_tokens,
            "spec_num_accepted_tokens_per_pos": list(spec.num_accepted_tokens_per_pos),
            "spec_proposer": self.runner.speculator.stats(),
        }

