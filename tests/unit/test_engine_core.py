"""EngineCore wiring, model-free: an injected scheduler and fake runner; idle checks, leases, connector."""

from __future__ import annotations

import pytest
from test_scheduler import FakeRunner, make_request, make_scheduler

from tandem.config import CacheConfig, EngineConfig
from tandem.engine.core import IDLE_CHECK_INTERVAL_S, EngineCore
from tandem.errors import EngineStepError
from tandem.kv_cache.storage import slot_of
from tandem.outputs import ModelRunnerOutput, SchedulerOutput


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class WiredRunner:
    """The engine's view of a runner over ``test_scheduler.FakeRunner`` (which plays the KV cache)."""

    max_model_len = 256
    speculator = None

    def cancel_grammars(self, request_ids: list[str]) -> None:
        """No grammar is ever compiled here (these tests have no structured output)."""

    def __init__(self, block_size: int) -> None:
        self.fake = FakeRunner()
        self.block_size = block_size
        self.fail = False

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self.fail and out.scheduled:
            raise MemoryError("simulated OOM mid-forward")
        return self.fake.execute(out, self.block_size)

    def block_hash_root(self, num_prompt_tokens: int) -> None:
        return None


class ListConnector:
    def __init__(self) -> None:
        self.ready: list[str] = []

    def ready_request_ids(self) -> list[str]:
        ready, self.ready = self.ready, []
        return ready


def make_core(clock: FakeClock, connector: ListConnector | None = None) -> EngineCore:
    sched = make_scheduler(block_size=4, num_blocks=16)
    sched.kv_cache_manager.leases.clock = clock
    return EngineCore(None, EngineConfig(cache=CacheConfig(block_size=4)), runner=WiredRunner(4),
                      scheduler=sched, kv_connector=connector, clock=clock)


def test_idle_check_is_rate_limited_and_catches_a_planted_leak():
    clock = FakeClock()
    core = make_core(clock)
    assert core.step() == []  # idle: the check runs and passes
    core.scheduler.kv_cache_manager.block_pool.get_new_blocks(1)  # leak one block
    assert core.step() == []  # within the interval: not checked again
    clock.now += IDLE_CHECK_INTERVAL_S
    with pytest.raises(AssertionError, match="ref_cnt 1, held by 0"):
        core.step()
    clock.now += IDLE_CHECK_INTERVAL_S
    with pytest.raises(AssertionError, match="ref_cnt 1, held by 0"):
        core.on_idle()  # what the engine-core process loop calls when it has no work


def test_idle_loop_expires_leases():
    clock = FakeClock()
    core = make_core(clock)
    req = make_request("p", 10, max_tokens=1)
    req.kv_lease_id = "L"
    core.add_request(req)
    core.step()
    kv = core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == 13 and core.stats().num_held_blocks == 3
    clock.now += 29.0
    core.on_idle()
    assert kv.num_free_blocks == 13
    clock.now += 1.0
    core.on_idle()
    assert kv.num_free_blocks == 16 and core.stats().num_held_blocks == 0


def test_failed_step_raises_a_typed_error_and_the_engine_keeps_serving():
    clock = FakeClock()
    core = make_core(clock)
    core.add_request(make_request("a", list(range(500, 510)), max_tokens=3))
    core.runner.fail = True
    with pytest.raises(EngineStepError) as failed:
        core.step()
    assert failed.value.request_ids == ["a"] and isinstance(failed.value.__cause__, MemoryError)
    assert not core.has_unfinished_requests() and core.scheduler.kv_cache_manager.block_pool.num_cached_blocks == 0
    core.runner.fail = False
    b = make_request("b", list(range(500, 510)), max_tokens=3)
    core.add_request(b)
    while core.has_unfinished_requests():
        core.step()
    assert b.output_token_ids == [7, 7, 7] and b.num_cached_tokens == 0
    core.scheduler.check()


def test_connector_reports_remote_kv_ready():
    clock, connector = FakeClock(), ListConnector()
    core = make_core(clock, connector)
    prompt = list(range(700, 710))
    req = make_request("r", list(prompt), max_tokens=2)
    table = core.scheduler.add_remote_kv_request(req, 8)
    assert core.step() == [] and req.num_computed_tokens == 0
    for pos in range(8):  # the transfer lands in the fake KV store
        core.runner.fake.slots[slot_of(table, pos, 4)] = tuple(prompt[: pos + 1])
    connector.ready.append("r")
    outputs = core.step()
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("r", [7])]
    assert core.stats().num_steps == 1


def test_connector_report_for_an_aborted_request_is_ignored():
    clock, connector = FakeClock(), ListConnector()
    core = make_core(clock, connector)
    core.scheduler.add_remote_kv_request(make_request("gone", 10), 8)
    core.abort_requests(["gone"])
    connector.ready.append("gone")
    assert core.step() == []
    kv = core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == 14  # held for the transfer that may still write them
    clock.now += 30.0
    core.on_idle()
    assert kv.num_free_blocks == 16
