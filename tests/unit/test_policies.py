"""Admission policies, model-free: FCFS and priority order, and not-ready requests that block nobody."""

from __future__ import annotations

import pytest
from test_scheduler import FakeRunner, make_request, make_scheduler, step

from tandem.config import CacheConfig, ConfigError, SchedulerConfig
from tandem.request import RequestStatus
from tandem.sampling_params import SamplingParams, SamplingParamsError
from tandem.scheduler import FCFSQueue, PriorityQueue, Scheduler, make_waiting_queue


def priority_scheduler(max_seqs: int = 1, num_blocks: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_seqs, policy="priority"),
                     CacheConfig(block_size=4), num_blocks=num_blocks, max_model_len=256)


def admission_order(sched: Scheduler, runner: FakeRunner) -> list[str]:
    """Ids in the order they were first scheduled, running to completion."""
    order: list[str] = []
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        order += [n.request_id for n in out.new_requests]
    return order


def test_priority_lower_value_first_ties_by_arrival():
    sched, runner = priority_scheduler(), FakeRunner()
    for i, (rid, prio) in enumerate([("a", 2), ("b", 0), ("c", 1), ("d", 0), ("e", -5)]):
        req = make_request(rid, 4, max_tokens=1, priority=prio)
        req.arrival_time = float(i)
        sched.add_request(req)
    assert [r.request_id for r in sched.waiting] == ["e", "b", "d", "c", "a"]
    assert admission_order(sched, runner) == ["e", "b", "d", "c", "a"]


def test_fcfs_ignores_priority():
    sched, runner = make_scheduler(max_seqs=1), FakeRunner()
    for rid, prio in [("a", 2), ("b", 0), ("c", 1)]:
        sched.add_request(make_request(rid, 4, max_tokens=1, priority=prio))
    assert admission_order(sched, runner) == ["a", "b", "c"]


def test_priority_preempted_request_returns_at_its_place():
    queue = PriorityQueue()
    reqs = {rid: make_request(rid, 4, priority=p) for rid, p in [("x", 1), ("y", 0), ("z", 1)]}
    for i, rid in enumerate("xyz"):
        reqs[rid].arrival_time = float(i)
    queue.add(reqs["y"])
    queue.add(reqs["z"])
    queue.add_preempted(reqs["x"])  # arrived before z with the same priority
    assert [r.request_id for r in queue] == ["y", "x", "z"]
    queue.remove(reqs["x"])
    queue.remove_ids({"y"})
    assert [r.request_id for r in queue] == ["z"] and len(queue) == 1
    with pytest.raises(ValueError, match="not queued"):
        queue.remove(reqs["x"])
    fcfs = FCFSQueue()
    fcfs.add(reqs["y"])
    fcfs.add_preempted(reqs["x"])
    assert [r.request_id for r in fcfs] == ["x", "y"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_not_ready_request_is_skipped_without_blocking_and_taken_once_ready(policy):
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, policy=policy),
                      CacheConfig(block_size=4), num_blocks=64, max_model_len=256)
    runner = FakeRunner()
    compiled = [False]
    grammar = make_request("grammar", 5, max_tokens=2)
    grammar.ready_check = lambda: compiled[0]
    sched.add_request(grammar)
    sched.add_request(make_request("behind", 5, max_tokens=5))
    out, _ = step(sched, runner)
    assert [r.request_id for r in out.scheduled] == ["behind"]
    assert grammar.status is RequestStatus.WAITING and list(sched.waiting) == [grammar]
    out, _ = step(sched, runner)
    assert [r.request_id for r in out.scheduled] == ["behind"]
    compiled[0] = True
    out, _ = step(sched, runner)
    assert [r.request_id for r in out.scheduled] == ["behind", "grammar"]
    assert out.scheduled[1].num_computed_tokens == 0 and len(out.scheduled[1].token_ids) == 5


def test_ready_requests_still_do_not_overtake_one_that_does_not_fit():
    sched, runner = make_scheduler(budget=64, num_blocks=6), FakeRunner()
    sched.add_request(make_request("running", 8, max_tokens=10))
    step(sched, runner)  # 2 (+1 for its decode) blocks in use
    waiting = make_request("not-ready", 4)
    waiting.ready_check = lambda: False
    sched.add_request(waiting)
    sched.add_request(make_request("big", 16))  # needs 5 blocks: does not fit
    sched.add_request(make_request("small", 2))  # would fit, but must not overtake "big"
    out, _ = step(sched, runner)
    assert [r.request_id for r in out.scheduled] == ["running"]


def test_policy_and_priority_are_validated():
    assert isinstance(make_waiting_queue("fcfs"), FCFSQueue)
    assert isinstance(make_waiting_queue("priority"), PriorityQueue)
    with pytest.raises(ConfigError, match="policy must be one of"):
        SchedulerConfig(policy="lifo")
    with pytest.raises(SamplingParamsError, match="priority must be an integer"):
        SamplingParams(priority=1.5)
    assert make_request("r", 3, priority=-3).priority == -3
