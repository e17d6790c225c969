"""``DataParallelLLM`` re-dispatches a prompt once when its engine core dies before any output reached
the client (no model: two fake engines with the real ``RequestStream`` / ``OutputCollector``, read the
way the HTTP handlers read them). Checks the output, ``tandem:request_redispatches_total{engine}`` and
that the router's outstanding counters (``/load``) end at 0."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tandem.engine.dp_llm import DataParallelLLM
from tandem.engine.request_stream import OutputCollector, PromptState, RequestStream
from tandem.errors import EngineDeadError, EngineRequestError
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.router.policy import make_policy
from tandem.sampling_params import SamplingParams
from tandem.server.metrics import DataParallelMetrics, ServerMetrics
from tandem.server.serving_common import final_outputs

PROMPT = list(range(1, 21))  # 20 tokens: one full block of 16
PARAMS = SamplingParams(max_tokens=8, temperature=0.0)
DIED = "the engine core process died"


class FakeEngine:
    """An ``AsyncLLM`` stand-in: accepts every prompt (refuses with ``refuse``; with ``hold``, leaves it
    waiting for acceptance), sends the outputs a test gives it (``emit``), and dies (``die``) as
    ``AsyncLLM._fail_in_flight`` does."""

    def __init__(self, rank: int) -> None:
        self.block_size, self.max_queue_len, self.max_model_len = 16, 0, 2048
        self.on_kv_events = self.on_core_lost = self.metrics = None
        self.client = SimpleNamespace(core_pid=None, pid=100 + rank, core_host="localhost")
        self.supervisor = SimpleNamespace(num_restarts=0)
        self.dead: EngineDeadError | None = None
        self.refuse: EngineRequestError | None = None
        self.hold = False
        self.states: dict[str, PromptState] = {}
        self.accepted: list[tuple[str, float]] = []  # (request id, arrival time)

    @property
    def is_healthy(self) -> bool:
        return self.dead is None

    def load(self) -> dict:
        return {"running": len(self.states), "waiting": 0, "kv_cache_usage": 0.0, "num_kv_blocks": 64,
                "healthy": self.is_healthy}

    async def add_request(self, request_id, prompt, prompt_token_ids, params, output_kind="delta",
                          arrival_time=None, on_end=None) -> RequestStream:
        if self.dead is not None:
            raise self.dead
        if self.refuse is not None:
            raise self.refuse
        loop = asyncio.get_running_loop()
        state = PromptState(request_id, prompt, prompt_token_ids, params, output_kind, [f"{request_id}-0"],
                            arrival_time, loop.create_future(), OutputCollector(delta=output_kind == "delta"))
        self.states[request_id] = state
        if not self.hold:
            state.accepted.set_result(None)
        await state.accepted
        self.accepted.append((request_id, arrival_time))
        return RequestStream(state, self.abort, on_end)

    def abort(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def emit(self, request_id: str, text: str, ids: list[int], finish: str | None = None) -> None:
        c = CompletionOutput(index=0, text=text, token_ids=ids, cumulative_logprob=None, logprobs=None,
                             finish_reason=finish)
        out = RequestOutput(request_id, None, PROMPT, [c], finished=finish is not None)
        state = self.states[request_id] if finish is None else self.states.pop(request_id)
        state.collector.put(out)

    def die(self, reason: str = DIED) -> None:
        self.dead = EngineDeadError(reason, 2.0)
        if self.on_core_lost is not None:
            self.on_core_lost()
        for state in self.states.values():
            if not state.accepted.done():
                state.accepted.set_exception(self.dead)
            state.collector.put(self.dead)
        self.states.clear()

    def end_all(self, reason: str) -> int:
        count = len(self.states)
        self.die(reason)
        return count


def make_dp() -> tuple[DataParallelLLM, FakeEngine, FakeEngine]:
    a, b = FakeEngine(0), FakeEngine(1)
    dp = DataParallelLLM([a, b], make_policy("least-load"), "dp-test")  # NOTE: idle ties go to engine 0
    dp.metrics = DataParallelMetrics([ServerMetrics("m", instance_id="dp-test", process=False) for _ in range(2)])
    return dp, a, b


def redispatches(dp: DataParallelLLM) -> dict[str, float]:
    return {rank: dp.metrics.registry.get_sample_value(
        "tandem:request_redispatches_total", {"model_name": "m", "instance_id": "dp-test", "engine": rank})
        for rank in ("0", "1")}


def outstanding(dp: DataParallelLLM) -> list[tuple[int, int]]:
    return [(e["outstanding_requests"], e["outstanding_tokens"]) for e in dp.load()["engines"]]


async def until(condition) -> None:
    """Lets the reader task run until ``condition()`` holds (bounded; no clock)."""
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


async def read_stream(stream, seen: list) -> None:
    async for out in stream:
        seen.append((out.outputs[0].text, out.outputs[0].token_ids))


def test_a_non_streamed_prompt_is_redispatched_when_its_engine_dies_mid_way():
    async def run():
        dp, a, b = make_dp()
        stream = await dp.add_request("r", None, PROMPT, PARAMS, "cumulative", arrival_time=5.0)
        task = asyncio.create_task(final_outputs([stream]))
        a.emit("r", " Once", [403])  # NOTE: a cumulative output the handler keeps to itself until the end
        await until(lambda: a.states["r"].collector._item is None)  # the handler took it
        assert outstanding(dp) == [(1, 28), (0, 0)]
        a.die()
        await until(lambda: "r" in b.states)
        mid = outstanding(dp)
        b.emit("r", " Once upon", [403, 407])
        b.emit("r", " Once upon a", [403, 407, 261], finish="length")
        (out,) = await task
        return dp, a, b, mid, out

    dp, a, b, mid, out = asyncio.run(run())
    assert (out.outputs[0].text, out.outputs[0].token_ids, out.finished) == (" Once upon a", [403, 407, 261], True)
    assert a.accepted == [("r", 5.0)] and b.accepted == [("r", 5.0)]  # TTFT still counts from the arrival
    assert mid == [(0, 0), (1, 28)]  # engine 0's counters released when it moved, engine 1's taken
    assert outstanding(dp) == [(0, 0), (0, 0)]
    assert redispatches(dp) == {"0": 1.0, "1": 0.0}
    assert not dp._live and not a.states and not b.states


def test_a_stream_is_redispatched_before_its_first_output_and_only_the_new_engines_output_is_read():
    async def run():
        dp, a, b = make_dp()
        stream = await dp.add_request("s", None, PROMPT, PARAMS, "delta")
        seen: list = []
        task = asyncio.create_task(read_stream(stream, seen))
        a.emit("s", " Once", [403])  # NOTE: still pending in the collector when the core dies: never read
        a.die()
        await until(lambda: "s" in b.states)
        b.emit("s", " Twice", [999])
        await until(lambda: seen)
        b.emit("s", " upon", [407], finish="length")
        await task
        return dp, seen

    dp, seen = asyncio.run(run())
    assert seen == [(" Twice", [999]), (" upon", [407])]
    assert redispatches(dp) == {"0": 1.0, "1": 0.0}
    assert outstanding(dp) == [(0, 0), (0, 0)] and not dp._live


def test_a_stream_that_read_an_output_ends_with_the_error_and_is_not_redispatched():
    async def run():
        dp, a, b = make_dp()
        stream = await dp.add_request("s", None, PROMPT, PARAMS, "delta")
        seen: list = []
        task = asyncio.create_task(read_stream(stream, seen))
        a.emit("s", " Once", [403])
        await until(lambda: seen)
        a.die()
        await until(task.done)
        with pytest.raises(EngineDeadError, match=DIED):
            await task
        return dp, b, seen

    dp, b, seen = asyncio.run(run())
    assert seen == [(" Once", [403])] and b.accepted == []
    assert redispatches(dp) == {"0": 0.0, "1": 0.0}
    assert outstanding(dp) == [(0, 0), (0, 0)] and not dp._live


@pytest.mark.parametrize("other", ["dead", "full", "dies_too"])
def test_a_prompt_whose_redispatch_fails_gets_the_engine_dead_error(other):
    """The other engine is down, full (429), or dies as well after taking the prompt: the reader gets
    an ``EngineDeadError`` (503); a prompt is re-dispatched at most once."""

    async def run():
        dp, a, b = make_dp()
        stream = await dp.add_request("r", None, PROMPT, PARAMS, "cumulative")
        task = asyncio.create_task(final_outputs([stream]))
        await asyncio.sleep(0)
        if other == "dead":
            b.die("engine 1 died first")
        elif other == "full":
            b.refuse = EngineRequestError(429, "the waiting queue is full", 1.0)
        a.die()
        if other == "dies_too":
            await until(lambda: "r" in b.states)
            a.dead = None  # NOTE: engine 0 is back (restarted): the prompt still does not move a second time
            b.die("engine 1 died as well")
        await until(task.done)
        with pytest.raises(EngineDeadError) as error:
            await task
        return dp, a, b, str(error.value)

    dp, a, b, message = asyncio.run(run())
    assert message == ("engine 1 died as well" if other == "dies_too" else DIED)
    assert len(a.accepted) == 1 and len(b.accepted) == (1 if other == "dies_too" else 0)
    assert redispatches(dp) == {"0": 1.0 if other == "dies_too" else 0.0, "1": 0.0}
    assert outstanding(dp) == [(0, 0), (0, 0)] and not dp._live and not b.states


def test_requests_ended_by_the_shutdown_are_not_redispatched():
    """Engine 1 still looks healthy when engine 0's requests fail (``shutdown`` reaches the engines one
    after the other): the shutdown's error is the answer."""

    async def run():
        dp, a, b = make_dp()
        b.end_all = lambda reason: 0
        stream = await dp.add_request("r", None, PROMPT, PARAMS, "cumulative")
        task = asyncio.create_task(final_outputs([stream]))
        await asyncio.sleep(0)
        assert dp.end_all("the server is shutting down") == 1
        await until(task.done)
        with pytest.raises(EngineDeadError, match="shutting down"):
            await task
        return dp, b

    dp, b = asyncio.run(run())
    assert b.accepted == [] and redispatches(dp) == {"0": 0.0, "1": 0.0}
    assert outstanding(dp) == [(0, 0), (0, 0)]


def test_a_prompt_moved_off_an_engine_that_died_while_accepting_it_is_counted_and_not_moved_again():
    async def run():
        dp, a, b = make_dp()
        a.hold = True
        adding = asyncio.create_task(dp.add_request("r", None, PROMPT, PARAMS, "cumulative"))
        await until(lambda: "r" in a.states)
        a.die()
        stream = await adding
        task = asyncio.create_task(final_outputs([stream]))
        a.dead, a.hold = None, False  # NOTE: engine 0 is back: a second death still ends the request
        await until(lambda: "r" in b.states)
        b.die("engine 1 died as well")
        await until(task.done)
        with pytest.raises(EngineDeadError, match="engine 1 died as well"):
            await task
        return dp, a, b

    dp, a, b = asyncio.run(run())
    assert a.accepted == [] and [rid for rid, _ in b.accepted] == ["r"]
    assert redispatches(dp) == {"0": 1.0, "1": 0.0}
    assert outstanding(dp) == [(0, 0), (0, 0)] and not dp._live
