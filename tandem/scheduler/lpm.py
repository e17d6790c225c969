"""Longest prefix match first (``SchedulerConfig.policy = "lpm"``): cached prompts before long uncached ones.

SGLang's ``--schedule-policy lpm`` (``python/sglang/srt/managers/schedule_policy.py``,
``_sort_by_longest_prefix``): each step the waiting queue is sorted by how many of each request's
tokens are already in the prefix cache, longest first. A request whose
prompt is mostly cached needs only a few tokens of the step's budget and samples its first token
at once, so it goes before a prompt that has to compute 1,000 tokens; on a CPU, where such a prompt
takes seconds per chunk, that is the difference between a sub-second and a many-second time to
first token. Ties (e.g. prompts with no hit) go to the request whose next block to compute the most
waiting requests share (SGLang's ``dfs-weight`` idea: compute first the prefix that unlocks the most
requests, which then hit it), then arrival (FCFS) order. Like SGLang, a queue longer than
``LPM_MAX_QUEUE`` is taken in FCFS order (no lookups).

Starvation bound (SGLang has none for LPM; its HRRN policy ages by tokens): a request that has
waited ``max_wait_steps`` scheduler steps since it was queued is *aged*. Aged requests go first, in
FCFS order, before every request that is not, so later arrivals with longer hits overtake a request
for at most ``max_wait_steps`` steps; after that only requests queued before it go first.

Only the order changes, never what a request computes: the tokens are those of FCFS (greedy output
is batch-invariant). No tensors, no state: the scheduler calls ``lpm_order`` once per step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from tandem.request import Request

LPM_MAX_QUEUE = 128  # SGLang's limit (``_determine_active_policy``): beyond it, FCFS


def lpm_order(queue: Iterable[Request], cached_tokens: Callable[[Request], int], step: int,
              max_wait_steps: int, block_size: int) -> list[Request]:
    """The admission order of this step under LPM, from the FCFS queue order.

    Args:
        queue: the waiting requests in FCFS order (preempted ones first, as the queue keeps them).
        cached_tokens: tokens of a request already in the KV cache or its own blocks (its prefix hit,
            or its received remote KV); called once per request that is not aged.
        step: the scheduler's step count now (``Scheduler.num_steps``).
        max_wait_steps: steps after its ``Request.queued_step`` from which a request is aged (>= 1).
        block_size: tokens per KV block (``request.block_hashes`` are per block).

    Returns:
        Aged requests in FCFS order, then the others by ``cached_tokens`` descending, then by how many
        of them share the hash of their first uncached block (descending), then in FCFS order (a
        stable sort). More than ``LPM_MAX_QUEUE`` requests: the FCFS order unchanged.
    Changes nothing (``cached_tokens`` may extend ``request.block_hashes``).
    """
    requests = list(queue)
    if len(requests) > LPM_MAX_QUEUE:
        return requests
    aged = [r for r in requests if step - r.queued_step >= max_wait_steps]
    fresh = [r for r in requests if step - r.queued_step < max_wait_steps]
    cached = {r.request_id: cached_tokens(r) for r in fresh}
    following = {r.request_id: _next_block(r, cached[r.request_id], block_size) for r in fresh}
    sharing = Counter(h for h in following.values() if h is not None)
    fresh.sort(key=lambda r: (-cached[r.request_id], -sharing[following[r.request_id]]))
    return aged + fresh


def _next_block(request: Request, num_cached: int, block_size: int) -> int | None:
    """The hash of the first block after ``num_cached`` tokens, None if that block is not full."""
    i = num_cached // block_size
    return request.block_hashes[i] if i < len(request.block_hashes) else None
