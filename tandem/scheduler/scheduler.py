"""The scheduler: one token budget per step, no prefill or decode phases (vLLM v1's rule).

Every request has ``num_computed_tokens`` (KV in the cache) and ``num_tokens`` (prompt + output).
Each step hands out at most ``max_num_batched_tokens`` tokens so requests catch up: a decode asks for
1 token, a prompt for a chunk. Running requests go first, in order; when the KV pool runs out the
newest running request is preempted (its blocks freed, recomputed later). Then waiting requests are
admitted first come, first served, reusing prefix-cache hits. Chunked prefill, prefix hits and
preemption all fall out of the two counters. The scheduler never touches tensors.

Speculative decoding (vLLM v1's design): a decode with s draft tokens asks for 1 + s tokens under the
same budget; after the step ``num_computed_tokens`` advances only over the accepted part (the rejected
drafts' slots stay in the block table and are overwritten later), accepted tokens go through the stop
checks one by one, and the runner's new drafts are stored on the request for the next step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from tandem.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tandem.kv_cache.manager import KVCacheManager, cdiv
from tandem.outputs import (
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from tandem.request import Request, RequestStatus
from tandem.spec_decode.metrics import SpecDecodeStats


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot for metrics: queue sizes, KV usage (0..1) and cumulative counters (tokens, events)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int


class Scheduler:
    """Decides which requests run each step and how many tokens each computes.

    Args:
        scheduler_config: token budget, sequence cap, long-prefill chunk cap.
        cache_config: block size and prefix caching switch (``num_blocks`` is passed resolved).
        num_blocks: KV blocks in the pool (the model runner allocates the same number).
        max_model_len: context limit in tokens (prompt + output).
        speculative_config: speculative decoding settings, or None. With a draft model, rows that sample
            for a speculating request also reserve ``num_speculative_tokens`` lookahead slots, where the
            draft writes the K/V of its proposals.

    ``self.max_model_len`` is ``min(max_model_len, num_blocks * block_size)``: a request alone must
    fit in the pool, otherwise it would preempt itself forever. So a pool smaller than the context
    ends requests with ``finish_reason="length"`` at the pool's size.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(num_blocks, cache_config.block_size,
                                               cache_config.enable_prefix_caching)
        self.max_model_len = min(max_model_len, num_blocks * cache_config.block_size)
        self.requests: dict[str, Request] = {}  # unfinished requests (waiting or running), by id
        self.waiting: deque[Request] = deque()  # WAITING or PREEMPTED, oldest first
        self.running: list[Request] = []  # RUNNING, in admission order (last = newest)
        self._finished_ids: set[str] = set()  # finished or aborted since the last schedule()
        self.num_preemptions_total = 0
        spec = speculative_config
        self.num_lookahead_tokens = spec.num_speculative_tokens if spec and spec.uses_draft_model else 0
        self.spec_stats = SpecDecodeStats(spec.num_speculative_tokens) if spec else None

    # ---- queues -------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks and scheduled each step (read-only)."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """New and preempted requests not yet (re)admitted (read-only)."""
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs. Changes nothing."""
        return bool(self.requests)

    def add_request(self, request: Request) -> None:
        """Queues a new request at the tail of the waiting queue (status WAITING).

        ``request.max_tokens`` must already be resolved (effective max new tokens, >= 1).
        Changes: the waiting queue and the request's status.

        Raises:
            ValueError: a duplicate id, an empty prompt, ``max_tokens < 1``, or a prompt longer than
                ``self.max_model_len`` (in particular one needing more blocks than the whole pool).
        """
        rid, num_prompt = request.request_id, request.num_prompt_tokens
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in the scheduler")
        if num_prompt == 0:
            raise ValueError(f"request {rid!r} has an empty prompt")
        if request.max_tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens must be >= 1, got {request.max_tokens}")
        pool_tokens = self.kv_cache_manager.num_blocks * self.block_size
        if num_prompt > pool_tokens:
            num_needed = cdiv(num_prompt, self.block_size)
            raise ValueError(
                f"request {rid!r}: the prompt of {num_prompt} tokens needs {num_needed} "
                f"KV blocks but the whole pool has {self.kv_cache_manager.num_blocks} ({pool_tokens} tokens)"
            )
        if num_prompt > self.max_model_len:
            raise ValueError(f"request {rid!r}: prompt of {num_prompt} tokens exceeds max_model_len "
                             f"{self.max_model_len}")
        request.status = RequestStatus.WAITING
        self.requests[rid] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Ends these requests wherever they are (status FINISHED_ABORTED); unknown ids are ignored.

        Changes: frees all their KV blocks at once, drops them from the queues, and reports them in
        the next ``SchedulerOutput.finished_request_ids``. Call between steps (not between
        ``schedule`` and ``update_from_output``, whose blocks the runner is writing).
        """
        aborted = {rid for rid in request_ids if rid in self.requests}
        if not aborted:
            return
        for rid in aborted:
            request = self.requests.pop(rid)
            request.status = RequestStatus.FINISHED_ABORTED
            self.kv_cache_manager.free(request)
        self.waiting = deque(r for r in self.waiting if r.request_id not in aborted)
        self.running = [r for r in self.running if r.request_id not in aborted]
        self._finished_ids |= aborted

    # ---- schedule -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Picks this step's requests and token counts within the budget.

        Running requests first (in order), preempting the newest running ones when blocks run out;
        then, if nothing was preempted, waiting requests FCFS until one does not fit.
        Changes: queues, statuses, block tables, ``num_computed_tokens`` of admitted requests (set to
        their prefix hit) and of preempted ones (reset to 0), ``num_cached_tokens`` and
        ``first_scheduled_time`` on a first admission, the preemption counters; hands over and
        clears the finished ids.
        """
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = set()
        budget = self.config.max_num_batched_tokens
        budget, out.num_preempted = self._schedule_running(out, budget)
        if out.num_preempted == 0:
            # NOTE: after a preemption the pool is full; admitting would only preempt again (vLLM).
            self._schedule_waiting(out, budget)
        return out

    def _chunk_size(self, request: Request, start: int, budget: int) -> int:
        """Tokens to compute from position ``start``: the rest, capped by chunk cap, budget and context."""
        n = request.num_tokens - start
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        return min(n, budget, self.max_model_len - start)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[int, int]:
        num_preempted = 0
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n, num_spec = self._plan_tokens(request, request.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            num_slots = n + self._num_lookahead(request, request.num_computed_tokens, n)
            block_ids = self.kv_cache_manager.allocate_slots(request, num_slots)
            while block_ids is None:
                # NOTE: the newest request is always behind i, so it was not scheduled this step.
                victim = self.running.pop()
                self._preempt(victim)
                num_preempted += 1
                if victim is request:
                    break
                block_ids = self.kv_cache_manager.allocate_slots(request, num_slots)
            if block_ids is None:
                break
            out.scheduled.append(self._row(request, n, block_ids, num_spec))
            budget -= n
            i += 1
        return budget, num_preempted

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0  # recompute prompt + output tokens (prefix hits may help)
        request.spec_token_ids = []  # NOTE: drafts are proposed again once the request has caught up
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        kv = self.kv_cache_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit_ids, num_hit = kv.get_computed_blocks(request)
            n = self._chunk_size(request, num_hit, budget)
            num_slots = n + self._num_lookahead(request, num_hit, n)
            block_ids = kv.allocate_slots(request, num_slots, hit_ids, num_hit)
            if block_ids is None:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                out.new_requests.append(NewRequestData(
                    request.request_id, list(request.prompt_token_ids), list(request.output_token_ids),
                    request.sampling_params, request.eos_token_ids,
                ))
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(self._row(request, n, block_ids))
            budget -= n

    def _plan_tokens(self, request: Request, start: int, budget: int) -> tuple[int, int]:
        """(tokens to compute from ``start``, of which draft tokens) for a running request.

        Drafts ride along only when the chunk reaches the last known token, and only as many as fit
        the budget, the chunk cap, ``max_tokens`` and the context: accepting s drafts yields s + 1
        tokens, so at most ``max_tokens - num_output_tokens - 1`` drafts can be of use.
        """
        n = self._chunk_size(request, start, budget)
        if n <= 0 or not request.spec_token_ids or start + n < request.num_tokens:
            return n, 0
        room = [len(request.spec_token_ids), budget - n,
                request.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens - 1]
        if self.config.long_prefill_token_threshold > 0:
            room.append(self.config.long_prefill_token_threshold - n)
        num_spec = max(0, min(room))
        return n + num_spec, num_spec

    def _num_lookahead(self, request: Request, start: int, n: int) -> int:
        """Extra slots a draft model needs after a row that samples (its proposals' K/V), within the context."""
        if not self.num_lookahead_tokens or not request.sampling_params.speculative or start + n < request.num_tokens:
            return 0
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - start - n))

    def _row(self, request: Request, n: int, block_ids: list[int], num_spec: int = 0) -> ScheduledRequest:
        start = request.num_computed_tokens
        num_real = n - num_spec
        token_ids = request.token_ids_slice(start, start + num_real) + request.spec_token_ids[:num_spec]
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=token_ids,
            num_computed_tokens=start,
            block_ids=block_ids,
            sample=start + num_real == request.num_tokens,
            num_spec_tokens=num_spec,
        )

    # ---- update -------------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Applies one step's results: advances counters, appends sampled tokens, applies stop rules.

        A row that verified s drafts gets 1 to s + 1 tokens (accepted drafts, then the target's own);
        ``num_computed_tokens`` advances over the scheduled tokens minus the rejected drafts, whose KV
        slots are simply overwritten later.
        Per new token, in order: ``stop_token_ids`` / EOS (EOS ignored with ``ignore_eos``; neither
        within the first ``min_tokens`` output tokens) -> "stop" (``stop_reason`` = the stop token id,
        None for EOS); ``max_tokens`` output tokens -> "length"; ``max_model_len`` tokens -> "length".
        The stop token stays in ``output_token_ids``; tokens sampled after a stop are dropped.

        Returns:
            One ``EngineCoreOutput`` per request that got new tokens or finished.
        Changes: ``num_computed_tokens``, ``output_token_ids``, ``spec_token_ids`` (replaced by the
        runner's new drafts), draft counters, status and ``stop_reason`` of the scheduled requests and
        ``spec_stats``; frees finished requests' blocks at once and queues their ids for the next
        ``finished_request_ids``.
        """
        outputs: list[EngineCoreOutput] = []
        any_finished = False
        for row in scheduler_output.scheduled:
            request = self.requests.get(row.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted since schedule()
            sampled = runner_output.sampled_token_ids.get(row.request_id, [])
            assert row.sample or not sampled, f"runner sampled for {row.request_id} without sample=True"
            num_rejected = self._verify_counts(request, row, sampled)
            request.num_computed_tokens += row.num_scheduled_tokens - num_rejected
            request.spec_token_ids = list(runner_output.spec_token_ids.get(row.request_id, ()))
            new_token_ids = self._append_tokens(request, sampled)
            if request.status.finished:
                self._free_finished(request)
                any_finished = True
            if new_token_ids or request.status.finished:
                outputs.append(self._make_output(request, new_token_ids, runner_output))
        if any_finished:
            self.running = [r for r in self.running if not r.status.finished]
        return outputs

    def _verify_counts(self, request: Request, row: ScheduledRequest, sampled: list[int]) -> int:
        """Counts a row's accepted drafts in the stats; returns how many of its drafts were rejected."""
        num_spec = row.num_spec_tokens
        if num_spec == 0:
            return 0
        num_accepted = len(sampled) - 1
        assert 0 <= num_accepted <= num_spec and sampled[:num_accepted] == row.spec_token_ids[:num_accepted], (
            f"runner returned {sampled} for drafts {row.spec_token_ids} of {row.request_id}")
        request.num_draft_tokens += num_spec
        request.num_accepted_tokens += num_accepted
        if self.spec_stats is not None:
            self.spec_stats.observe(num_spec, num_accepted)
        return num_spec - num_accepted

    def _append_tokens(self, request: Request, sampled: list[int]) -> list[int]:
        new_token_ids: list[int] = []
        for token_id in sampled:
            request.output_token_ids.append(token_id)
            new_token_ids.append(token_id)
            if self._check_stop(request, token_id):
                break
        return new_token_ids

    def _check_stop(self, request: Request, token_id: int) -> bool:
        """Sets a finished status (and ``stop_reason``) if ``token_id``, just appended, ends the request."""
        params = request.sampling_params
        # NOTE: the first min_tokens tokens never stop; the sampler also masks them (vLLM's min_tokens).
        if request.num_output_tokens > params.min_tokens:
            if token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return True
            if not params.ignore_eos and token_id in request.eos_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = None
                return True
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _free_finished(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)

    def _make_output(
        self, request: Request, new_token_ids: list[int], runner_output: ModelRunnerOutput
    ) -> EngineCoreOutput:
        logprobs = runner_output.logprobs.get(request.request_id)
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=None if logprobs is None else logprobs[: len(new_token_ids)],
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens,
        )

    # ---- introspection ------------------------------------------------------------------------

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks owned by requests (0..1)."""
        return self.kv_cache_manager.usage

    def make_stats(self) -> SchedulerStats:
        """A metrics snapshot. Changes nothing."""
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting), kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions_total,
        )

    def check(self) -> None:
        """Verifies queue/status/block-table consistency and the KV cache invariants. Changes nothing.

        Raises:
            AssertionError: an inconsistency (a bug, never a user error).
        """
        running_ids = {r.request_id for r in self.running}
        waiting_ids = {r.request_id for r in self.waiting}
        problems = [
            (not running_ids & waiting_ids, "a request is both running and waiting"),
            (running_ids | waiting_ids == set(self.requests), "queues and the request map disagree"),
            (len(running_ids) == len(self.running) and len(waiting_ids) == len(self.waiting), "duplicates"),
            (all(r.status is RequestStatus.RUNNING for r in self.running), "a running request's status"),
            (all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in self.waiting),
             "a waiting request has a wrong status"),
            (self.kv_cache_manager.request_ids == running_ids, "block owners are not the running requests"),
            (len(self.running) <= self.config.max_num_seqs, "more running requests than max_num_seqs"),
        ]
        for ok, message in problems:
            if not ok:
                raise AssertionError(f"scheduler integrity: {message}")
        self.kv_cache_manager.check()
