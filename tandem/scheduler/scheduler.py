"""The scheduler: one token budget per step, no prefill or decode phases (vLLM v1's rule).

Every request has ``num_computed_tokens`` (KV in the cache) and ``num_tokens`` (prompt + output).
Each step hands out at most ``max_num_batched_tokens`` tokens so requests catch up: a decode asks for
1 token, a prompt for a chunk. Running requests go first, in order; when the KV pool runs out the
newest running request is preempted (its blocks freed, recomputed later). Then waiting requests are
admitted in the policy's order (``policies.py``: FCFS or priority; ``lpm.py``: longest prefix hit
first, with a bound on how long a request is overtaken), reusing prefix-cache hits and
skipping requests that are not ready yet (remote KV on the wire, a grammar compiling) or that the
``AdmissionGate`` holds back (``admission.py``: their prefix is being computed by a running request, or
too many long prompts run already). Chunked
prefill, prefix hits and preemption all fall out of the two counters. The scheduler never touches
tensors.

KV blocks enter the prefix cache only once written: ``update_from_output`` registers the full blocks
the step computed, so a step that fails (``abort_step``) leaves no block hashable that it did not
write. A request whose first tokens' KV comes from elsewhere (``add_remote_kv_request``) owns its
blocks while WAITING_FOR_REMOTE_KV, and becomes admissible with ``mark_remote_kv_ready``.

Speculative decoding (vLLM v1's design): a decode with s draft tokens asks for 1 + s tokens under the
same budget; after the step ``num_computed_tokens`` advances only over the accepted part (the rejected
drafts' slots stay in the block table and are overwritten later), accepted tokens go through the stop
checks one by one, and the runner's new drafts are stored on the request for the next step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from tandem.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tandem.errors import ContextLengthExceededError, DuplicateRequestError
from tandem.kv_cache.manager import KVCacheManager, cdiv
from tandem.outputs import (
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tandem.request import Request, RequestStatus
from tandem.scheduler.admission import AdmissionGate
from tandem.scheduler.integrity import check_scheduler
from tandem.scheduler.lpm import lpm_order
from tandem.scheduler.planning import TokenPlanner, make_row
from tandem.scheduler.policies import make_waiting_queue
from tandem.scheduler.remote_kv import RemoteKVMixin
from tandem.scheduler.results import append_tokens, make_output, verify_counts
from tandem.scheduler.stats import SchedulerStats
from tandem.spec_decode.metrics import SpecDecodeStats


class Scheduler(RemoteKVMixin):
    """Decides which requests run each step and how many tokens each computes.

    Args:
        scheduler_config: token budget, sequence cap, long-prefill chunk cap.
        cache_config: block size and prefix caching switch (``num_blocks`` is passed resolved).
        num_blocks: KV blocks in the pool (the model runner allocates the same number).
        max_model_len: context limit in tokens (prompt + output).
        speculative_config: speculative decoding settings, or None. With a draft model, rows that sample
            for a speculating request also reserve ``num_speculative_tokens`` lookahead slots, where the
            draft writes the K/V of its proposals.
        clock: monotonic clock (seconds) for KV lease expiry; tests inject a fake one.
        sliding_window: tokens every layer attends back to when all layers slide (``ModelRunner.kv_window``);
            then blocks out of the window are freed while a request runs (``KVCacheManager``). None: never.

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
        clock: Callable[[], float] = time.monotonic,
        sliding_window: int | None = None,
    ) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(num_blocks, cache_config.block_size,
                                               cache_config.enable_prefix_caching, clock=clock,
                                               sliding_window=sliding_window)
        self.max_model_len = min(max_model_len, num_blocks * cache_config.block_size)
        self.requests: dict[str, Request] = {}  # unfinished requests (waiting or running), by id
        self.waiting = make_waiting_queue(scheduler_config.policy)  # WAITING, PREEMPTED, WAITING_FOR_REMOTE_KV
        self.running: list[Request] = []  # RUNNING, in admission order (last = newest)
        self.remote_kv_tokens: dict[str, int] = {}  # WAITING_FOR_REMOTE_KV id -> tokens whose KV will arrive
        self._finished_ids: set[str] = set()  # finished or aborted since the last schedule()
        self.failed: list[tuple[str, str]] = []  # (id, why) ended by a runner failure, drained by the engine
        self.num_preemptions_total = 0
        self.num_steps = 0  # steps whose results were applied (update_from_output)
        spec = speculative_config
        self.num_lookahead_tokens = spec.num_speculative_tokens if spec and spec.uses_draft_model else 0
        self.spec_stats = SpecDecodeStats(spec.num_speculative_tokens) if spec else None
        self.planner = TokenPlanner(scheduler_config.long_prefill_token_threshold, self.max_model_len,
                                    self.num_lookahead_tokens)

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
        """Queues a new request in the waiting queue (status WAITING), in the policy's order.

        ``request.max_tokens`` must already be resolved (effective max new tokens, >= 1).
        Changes: the waiting queue and the request's status.

        Raises:
            DuplicateRequestError: the id is already queued or running (a ``ValueError``).
            ContextLengthExceededError: the prompt is longer than ``self.max_model_len`` (a ``ValueError``).
            ValueError: an empty prompt, ``max_tokens < 1``, or a prompt needing more blocks than the pool.
        """
        self._validate_new(request)
        request.status = RequestStatus.WAITING
        request.queued_step = self.num_steps
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def _validate_new(self, request: Request) -> None:
        rid, num_prompt = request.request_id, request.num_prompt_tokens
        if rid in self.requests:
            raise DuplicateRequestError(rid)
        if num_prompt == 0:
            raise ValueError(f"request {rid!r} has an empty prompt")
        prompt_only = request.max_tokens == 0 and request.sampling_params.prompt_logprobs is not None
        if request.max_tokens < 1 and not prompt_only:  # NOTE: 0 runs the prompt alone, for its logprobs
            raise ValueError(f"request {rid!r}: max_tokens must be >= 1, got {request.max_tokens}")
        pool_tokens = self.kv_cache_manager.num_blocks * self.block_size
        if num_prompt > pool_tokens:
            num_needed = cdiv(num_prompt, self.block_size)
            raise ValueError(
                f"request {rid!r}: the prompt of {num_prompt} tokens needs {num_needed} "
                f"KV blocks but the whole pool has {self.kv_cache_manager.num_blocks} ({pool_tokens} tokens)"
            )
        if request.kv_lease_id is not None and request.kv_lease_id in self.kv_cache_manager.leases:
            raise ValueError(f"request {rid!r}: KV lease {request.kv_lease_id!r} is already in use")
        if num_prompt > self.max_model_len:
            raise ContextLengthExceededError(
                f"request {rid!r}: prompt of {num_prompt} tokens exceeds max_model_len {self.max_model_len}",
                num_prompt, self.max_model_len)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Ends these requests wherever they are (status FINISHED_ABORTED); unknown ids are ignored.

        Changes: frees all their KV blocks at once, drops them from the queues, and reports them in
        the next ``SchedulerOutput.finished_request_ids``. Call between steps (not between
        ``schedule`` and ``update_from_output``, whose blocks the runner is writing).
        A request still WAITING_FOR_REMOTE_KV has its blocks held under the lease
        ``f"aborted-remote:{request_id}"`` instead (a transfer may still be writing them): the
        connector releases it once the transfer stopped, or it expires.
        """
        aborted = {rid for rid in request_ids if rid in self.requests}
        if not aborted:
            return
        for rid in aborted:
            request = self.requests.pop(rid)
            request.status = RequestStatus.FINISHED_ABORTED
            if self.remote_kv_tokens.pop(rid, None) is not None:
                self.kv_cache_manager.hold(request, f"aborted-remote:{rid}")
            else:
                self.kv_cache_manager.free(request)
        self.waiting.remove_ids(aborted)
        self.running = [r for r in self.running if r.request_id not in aborted]
        self._finished_ids |= aborted

    def abort_step(self, scheduler_output: SchedulerOutput) -> list[str]:
        """Rolls back a step whose execution failed: aborts its scheduled requests; returns their ids.

        The step's blocks were allocated but never registered in the prefix cache (that happens in
        ``update_from_output``), so freeing them leaves the cache as if the step never ran; the
        runner drops the requests' state at the next step (``finished_request_ids``).
        Changes: as ``abort_requests``.
        """
        ids = [row.request_id for row in scheduler_output.scheduled if row.request_id in self.requests]
        self.abort_requests(ids)
        self._finished_ids |= scheduler_output.finished_request_ids  # the runner may not have seen them
        return ids

    # ---- schedule -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Picks this step's requests and token counts within the budget.

        Running requests first (in order), preempting the newest running ones when blocks run out;
        then, if nothing was preempted, ready waiting requests in policy order until one does not
        fit (requests that are not ready are skipped and keep their place).
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

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[int, int]:
        num_preempted = 0
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n, num_spec = self.planner.plan_tokens(request, request.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            num_slots = n + self.planner.num_lookahead(request, request.num_computed_tokens, n)
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
            out.scheduled.append(make_row(request, n, block_ids, num_spec))
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
        request.queued_step = self.num_steps
        self.waiting.add_preempted(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        gate = AdmissionGate(self.running, self.block_size, self.kv_cache_manager.enable_prefix_caching,
                             self.config.long_prefill_token_threshold, self.config.max_long_partial_prefills)
        order = self.waiting  # a snapshot, in policy order
        if self.config.policy == "lpm":
            order = lpm_order(order, lambda r: self._prefix(r)[2], self.num_steps, self.config.lpm_max_wait_steps,
                              self.block_size)
        for request in order:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if not request.is_ready():
                continue  # skipped, keeps its place, blocks nobody
            n = self._admit(out, request, budget, gate)
            if n is None:
                continue  # held back by the gate (admission.py), keeps its place
            if n == 0:
                return  # no ready request overtakes one that does not fit
            budget -= n

    def _admit(self, out: SchedulerOutput, request: Request, budget: int, gate: AdmissionGate) -> int | None:
        """Moves a ready waiting request to running with its first chunk; returns its tokens (0: no room,
        None: ``gate`` holds it back this step)."""
        kv = self.kv_cache_manager
        hit_ids, num_hit, start, may_hit = self._prefix(request)
        if gate.holds_back(request, start, hit_possible=may_hit):
            return None
        n = self.planner.chunk_size(request, start, budget)
        num_slots = n + self.planner.num_lookahead(request, start, n)
        block_ids = kv.allocate_slots(request, num_slots, hit_ids, num_hit)
        if block_ids is None:
            return 0
        self.waiting.remove(request)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
            out.new_requests.append(NewRequestData(
                request.request_id, list(request.prompt_token_ids), list(request.output_token_ids),
                request.sampling_params, request.eos_token_ids,
            ))
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
        request.num_computed_tokens = start
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        gate.admitted(request, start)
        out.scheduled.append(make_row(request, n, block_ids))
        return n

    def _prefix(self, request: Request) -> tuple[list[int], int, int, bool]:
        """(hit block ids, hit tokens, first token to compute, whether a hit was possible) of a waiting
        request. Changes nothing but ``request.block_hashes`` (extended)."""
        if request.num_computed_tokens > 0:  # its first tokens' KV came from elsewhere, blocks owned
            return [], 0, request.num_computed_tokens, False
        if request.sampling_params.prompt_logprobs is not None and not request.output_token_ids:
            # NOTE: cached blocks have no logits; prompt logprobs need every position computed (vLLM too).
            return [], 0, 0, False
        hit_ids, num_hit = self.kv_cache_manager.get_computed_blocks(request)
        return hit_ids, num_hit, num_hit, True

    # ---- update -------------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Applies one step's results: advances counters, appends sampled tokens, applies stop rules.

        A row that verified s drafts gets 1 to s + 1 tokens (accepted drafts, then the target's own);
        ``num_computed_tokens`` advances over the scheduled tokens minus the rejected drafts, whose KV
        slots are simply overwritten later.
        Per new token, in order (``results.check_stop``, vLLM's): EOS (ignored with ``ignore_eos``) ->
        "stop" with ``stop_reason`` None; a stop token id -> "stop" with it (neither within the first
        ``min_tokens`` output tokens); ``max_tokens`` output tokens -> "length"; ``max_model_len`` tokens
        -> "length".
        The stop token stays in ``output_token_ids``; tokens sampled after a stop are dropped.

        Returns:
            One ``EngineCoreOutput`` per request that got new tokens or finished.
        Changes: ``num_computed_tokens``, ``output_token_ids``, ``spec_token_ids`` (replaced by the
        runner's new drafts), draft counters, status and ``stop_reason`` of the scheduled requests and
        ``spec_stats``; registers the full blocks the step wrote in the prefix cache; frees finished
        requests' blocks at once (or holds them under ``request.kv_lease_id``) and queues their ids
        for the next ``finished_request_ids``; ``num_steps``. Requests in ``runner_output.failed``
        are aborted (their tokens dropped, blocks freed) and listed in ``failed``.
        """
        self.num_steps += 1
        outputs: list[EngineCoreOutput] = []
        any_finished = False
        for row in scheduler_output.scheduled:
            request = self.requests.get(row.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted since schedule()
            if row.request_id in runner_output.failed:
                continue  # NOTE: ended below, as an abort (its blocks freed, none registered)
            sampled = runner_output.sampled_token_ids.get(row.request_id, [])
            assert row.sample or not sampled, f"runner sampled for {row.request_id} without sample=True"
            num_rejected = verify_counts(request, row, sampled, self.spec_stats)
            request.num_computed_tokens += row.num_scheduled_tokens - num_rejected
            self.kv_cache_manager.cache_written_blocks(request)  # the step ran: its KV is written
            request.spec_token_ids = list(runner_output.spec_token_ids.get(row.request_id, ()))
            new_token_ids = append_tokens(request, sampled, self.max_model_len)
            if request.status.finished:
                self._free_finished(request)
                any_finished = True
            if new_token_ids or request.status.finished:
                outputs.append(make_output(request, new_token_ids, runner_output))
        if any_finished:
            self.running = [r for r in self.running if not r.status.finished]
        self._fail(runner_output.failed)
        return outputs

    def _fail(self, failed: dict[str, str]) -> None:
        """Aborts the requests the runner could not go on with and lists them in ``failed``."""
        ids = [rid for rid in failed if rid in self.requests]
        self.abort_requests(ids)
        self.failed.extend((rid, failed[rid]) for rid in ids)

    def _free_finished(self, request: Request) -> None:
        if request.kv_lease_id is not None:
            self.kv_cache_manager.hold(request, request.kv_lease_id)
        else:
            self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)

    # ---- introspection ------------------------------------------------------------------------

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks owned by requests (0..1)."""
        return self.kv_cache_manager.usage

    def make_stats(self, proposer_stats: dict[str, float] | None = None) -> SchedulerStats:
        """A metrics snapshot; ``proposer_stats`` are the runner's proposer counters. Changes nothing."""
        return SchedulerStats.of(self, proposer_stats)

    def check(self) -> None:
        """Verifies queues, statuses, block owners and the KV cache invariants (``integrity.py``).

        Changes nothing. Raises AssertionError on an inconsistency (a bug, never a user error).
        """
        check_scheduler(self)
