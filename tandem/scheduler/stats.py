"""SchedulerStats: the one metrics snapshot of an engine, from the scheduler to ``/metrics``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.spec_decode.metrics import acceptance_rate, mean_acceptance_length

if TYPE_CHECKING:
    from tandem.scheduler.scheduler import Scheduler


@dataclass(frozen=True)
class SchedulerStats:
    """Queue sizes, KV usage (0..1) and cumulative counters (tokens, events, steps) of one engine.

    Built by ``Scheduler.make_stats`` (``EngineCore.stats`` adds the proposer's own counters).
    The speculative fields are all 0 without speculative decoding: verifications, draft tokens
    verified and accepted, accepted per draft position, and the proposer's counters (draft
    forwards, seconds, ...).
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int = 0
    num_held_blocks: int = 0  # block references pinned by leases after their request finished
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    spec_proposer: dict[str, float] = field(default_factory=dict)
    kv_transfer: dict[str, float] = field(default_factory=dict)  # the KV connector's counters (tandem/disagg)

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / verified draft tokens (0.0 before any draft)."""
        return acceptance_rate(self.spec_num_accepted_tokens, self.spec_num_draft_tokens)

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens per verification step: 1 + accepted drafts per step (0.0 before any draft)."""
        return mean_acceptance_length(self.spec_num_accepted_tokens, self.spec_num_drafts)

    @classmethod
    def of(cls, sched: Scheduler, proposer_stats: dict[str, float] | None = None) -> SchedulerStats:
        """The snapshot of ``sched`` now; speculative fields only with ``proposer_stats`` (the runner's)."""
        kv = sched.kv_cache_manager
        spec = {}
        if sched.spec_stats is not None and proposer_stats is not None:
            st = sched.spec_stats
            spec = {"spec_num_drafts": st.num_drafts, "spec_num_draft_tokens": st.num_draft_tokens,
                    "spec_num_accepted_tokens": st.num_accepted_tokens,
                    "spec_num_accepted_tokens_per_pos": list(st.num_accepted_tokens_per_pos),
                    "spec_proposer": dict(proposer_stats)}
        return cls(
            num_running=sched.num_running, num_waiting=sched.num_waiting, kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=sched.num_preemptions_total, num_steps=sched.num_steps,
            num_held_blocks=kv.num_held_blocks, **spec,
        )
