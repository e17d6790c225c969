"""The scheduler's integrity check, run by the engine core when idle and by tests (changes nothing).

Checks that the queues and the request map agree, that statuses match queues, that block owners are
exactly the running requests plus the waiting ones whose KV came (or comes) from elsewhere, then the
KV cache manager's own check (ref counts vs block tables and leases, free queue vs ref 0, no hash on
an unwritten block).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.request import RequestStatus

if TYPE_CHECKING:
    from tandem.scheduler.scheduler import Scheduler

_WAITING_STATES = (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.WAITING_FOR_REMOTE_KV)


def check_scheduler(sched: Scheduler) -> None:
    """Raises AssertionError naming the first broken invariant of ``sched``. Changes nothing."""
    running_ids = {r.request_id for r in sched.running}
    waiting = list(sched.waiting)
    waiting_ids = {r.request_id for r in waiting}
    remote_ids = {r.request_id for r in waiting
                  if r.status is RequestStatus.WAITING_FOR_REMOTE_KV or r.num_computed_tokens > 0}
    problems = [
        (not running_ids & waiting_ids, "a request is both running and waiting"),
        (running_ids | waiting_ids == set(sched.requests), "queues and the request map disagree"),
        (len(running_ids) == len(sched.running) and len(waiting_ids) == len(waiting), "duplicates"),
        (all(r.status is RequestStatus.RUNNING for r in sched.running), "a running request's status"),
        (all(r.status in _WAITING_STATES for r in waiting), "a waiting request has a wrong status"),
        ({r.request_id for r in waiting if r.status is RequestStatus.WAITING_FOR_REMOTE_KV}
         == set(sched.remote_kv_tokens), "requests waiting for remote KV disagree"),
        (sched.kv_cache_manager.request_ids == running_ids | remote_ids,
         "block owners are not the running requests (plus those with remote KV)"),
        (len(sched.running) <= sched.config.max_num_seqs, "more running requests than max_num_seqs"),
    ]
    for ok, message in problems:
        if not ok:
            raise AssertionError(f"scheduler integrity: {message}")
    sched.kv_cache_manager.check()
