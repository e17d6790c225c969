"""AsyncLLM and the completions handler without a core process (a fake client answers by hand):
admission counts prompts still being tokenized (429 before the tokenizer queue grows), TTFT starts
when the handler got the request, detokenization runs in its own thread, duplicate ids are a 400."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from transformers import AutoTokenizer

from tandem.engine.async_llm import AsyncLLM
from tandem.engine.core_proc import AddResult, CoreStats, StepOutputs
from tandem.engine.loading import Frontend
from tandem.errors import DuplicateRequestError, EngineDeadError, EngineRequestError
from tandem.models.hf_config import load_hf_config
from tandem.outputs import EngineCoreOutput
from tandem.sampling_params import SamplingParams
from tandem.server import errors
from tandem.server.protocol import CompletionRequest
from tandem.server.serving_common import ModelNames
from tandem.server.serving_completions import OpenAIServingCompletion


class FakeClient:
    """Records adds; ``outputs`` is what the core would send (fed by the test)."""

    max_model_len = 512
    block_size = 16
    num_blocks = 64
    pid = None

    def __init__(self) -> None:
        self.added: list[str] = []
        self.outputs: asyncio.Queue = asyncio.Queue()

    def add_requests(self, parent_id, requests):
        self.added.append(parent_id)

    def abort_requests(self, request_ids):
        pass

    def is_alive(self):
        return True

    def attach(self, on_death):
        pass

    def detach(self):
        pass

    def close(self, timeout_s=5.0):
        pass

    async def get_output(self):
        return await self.outputs.get()


class FakeMetrics:
    def __init__(self) -> None:
        self.ttfts: list[float] = []

    def record_step(self, stats, num_batched_tokens):
        pass

    def record_queue_time(self, seconds):
        pass

    def record_first_token(self, ttft, num_prompt_tokens):
        self.ttfts.append(ttft)

    def record_tokens(self, num_tokens, itl):
        pass

    def record_finished(self, finish_reason, e2e):
        pass

    def clear_gauges(self):
        pass


@pytest.fixture(scope="module")
def frontend(stories_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(stories_dir))
    return Frontend(stories_dir, load_hf_config(stories_dir), tokenizer, SamplingParams(), None)


def block_tokenizer(engine: AsyncLLM) -> threading.Event:
    """Occupies the tokenizer thread until the returned event is set."""
    release = threading.Event()
    engine._tokenizer_thread.submit(release.wait, 10)
    return release


def test_prompts_being_tokenized_count_against_the_queue_bound(frontend):
    engine = AsyncLLM(frontend, FakeClient(), max_queue_len=2)
    handler = OpenAIServingCompletion(engine, ModelNames(["m"]))

    async def run():
        release = block_tokenizer(engine)
        first = [asyncio.create_task(handler.create(CompletionRequest(prompt="Hi", max_tokens=2))) for _ in range(2)]
        await asyncio.sleep(0.05)  # both admitted, both waiting for the tokenizer thread
        assert engine.load()["waiting"] == 2
        with pytest.raises(EngineRequestError) as info:
            await handler.create(CompletionRequest(prompt="Hi", max_tokens=2))
        release.set()
        for task in first:
            task.cancel()
        await asyncio.gather(*first, return_exceptions=True)
        return info.value

    refused = asyncio.run(run())
    api = errors.from_engine_error(refused)
    assert api.status == 429 and api.headers() == {"Retry-After": "1"}
    assert api.body() == {"error": {"message": "the waiting queue is full (2 requests); retry later",
                                    "type": "rate_limit_error", "param": None, "code": "queue_full"}}
    assert engine.load()["waiting"] == 0  # released when the handlers ended


def test_ttft_starts_when_the_handler_got_the_request_and_text_is_detokenized_off_the_loop(frontend):
    client, metrics = FakeClient(), FakeMetrics()
    engine = AsyncLLM(frontend, client, metrics)
    handler = OpenAIServingCompletion(engine, ModelNames(["m"]))
    threads = []
    process = engine.output_processor.process_outputs

    def spy(outputs):
        threads.append(threading.current_thread().name)
        return process(outputs)

    engine.output_processor.process_outputs = spy

    async def run():
        await engine.start()
        release = block_tokenizer(engine)
        arrival = time.monotonic()
        task = asyncio.create_task(handler.create(CompletionRequest(prompt="Once upon", max_tokens=2), arrival))
        await asyncio.sleep(0.3)  # the tokenizer thread is busy: this wait is part of TTFT
        release.set()
        while not client.added:
            await asyncio.sleep(0.01)
        rid = client.added[0]
        client.outputs.put_nowait(AddResult(rid, 200))
        client.outputs.put_nowait(StepOutputs([EngineCoreOutput(rid, [403])], CoreStats()))
        client.outputs.put_nowait(StepOutputs([EngineCoreOutput(rid, [407], finish_reason="length")], CoreStats()))
        response = await task
        await engine.shutdown()
        return response

    response = asyncio.run(run())
    assert response.status_code == 200
    assert json.loads(response.body)["choices"] == [
        {"index": 0, "text": " Once upon", "logprobs": None, "finish_reason": "length", "stop_reason": None,
         "prompt_logprobs": None,
         "prompt_token_ids": None, "token_ids": None}]
    assert len(metrics.ttfts) == 1 and metrics.ttfts[0] >= 0.3
    assert threads and all(name.startswith("tandem-detokenizer") for name in threads)


def test_a_request_id_in_flight_is_a_duplicate_400(frontend):
    engine = AsyncLLM(frontend, FakeClient())

    async def run():
        task = asyncio.create_task(engine.add_request("r1", None, [1, 2], SamplingParams(max_tokens=2)))
        await asyncio.sleep(0)
        with pytest.raises(DuplicateRequestError) as info:
            await engine.add_request("r1", None, [1, 2], SamplingParams(max_tokens=2))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return info.value

    api = errors.from_value_error(asyncio.run(run()))
    assert api.status == 400
    assert api.body() == {"error": {"message": "request id 'r1' is already in use", "type": "invalid_request_error",
                                    "param": "request_id", "code": "duplicate_request_id"}}


def test_a_failed_step_ends_only_its_requests_with_a_500(frontend):
    from tandem.engine.core_proc import StepFailed

    client = FakeClient()
    engine = AsyncLLM(frontend, client, FakeMetrics())

    async def run():
        await engine.start()
        tasks = [asyncio.create_task(engine.add_request(rid, None, [1, 403], SamplingParams(max_tokens=2)))
                 for rid in ("hit", "other")]
        await asyncio.sleep(0)
        for rid in ("hit", "other"):
            client.outputs.put_nowait(AddResult(rid, 200))
        hit, other = await asyncio.gather(*tasks)
        client.outputs.put_nowait(StepFailed(["hit"], "RuntimeError: boom"))
        with pytest.raises(EngineRequestError) as info:
            async for _ in hit:
                pass
        client.outputs.put_nowait(StepOutputs([EngineCoreOutput("other", [407], finish_reason="length")], CoreStats()))
        outs = [out async for out in other]
        await engine.shutdown()
        return info.value, outs

    error, outs = asyncio.run(run())
    assert errors.from_engine_error(error).body() == {"error": {
        "message": "the engine step failed: RuntimeError: boom", "type": "internal_error", "param": None,
        "code": "engine_step_failed"}}
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == [407]


def test_a_bug_in_the_output_loop_fails_requests_instead_of_hanging(frontend):
    client = FakeClient()
    engine = AsyncLLM(frontend, client, FakeMetrics())

    def broken(outputs):
        raise KeyError("bug")

    engine.output_processor.process_outputs = broken

    async def run():
        await engine.start()
        task = asyncio.create_task(engine.add_request("r", None, [1, 403], SamplingParams(max_tokens=2)))
        await asyncio.sleep(0)
        client.outputs.put_nowait(AddResult("r", 200))
        stream = await task
        client.outputs.put_nowait(StepOutputs([EngineCoreOutput("r", [407])], CoreStats()))
        with pytest.raises(EngineDeadError) as info:
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError) as later:
            engine.check_available()
        await engine.shutdown()
        return str(info.value), str(later.value)

    first, later = asyncio.run(run())
    assert first == "the engine front end failed: KeyError: 'bug'"
    assert later == "the engine front end failed: KeyError: 'bug'; it is not restarted (restarts are off)"


def test_a_slow_grammar_check_runs_off_the_event_loop(frontend, monkeypatch):
    """While one request's llguidance check is held (standing for a large grammar's), another request
    is answered; then the held one finishes. With the check on the event loop the order would flip."""
    from tandem.server import serving_common

    client = FakeClient()
    engine = AsyncLLM(frontend, client, FakeMetrics())
    handler = OpenAIServingCompletion(engine, ModelNames(["m"]))
    release, order = threading.Event(), []
    check = serving_common.check_grammar

    def held_check(*args):
        release.wait(10)
        order.append("check")
        return check(*args)

    monkeypatch.setattr(serving_common, "check_grammar", held_check)

    async def answer(rid: str) -> None:
        while rid not in client.added:
            await asyncio.sleep(0.01)
        client.outputs.put_nowait(AddResult(rid, 200))
        client.outputs.put_nowait(StepOutputs([EngineCoreOutput(rid, [403], finish_reason="length")], CoreStats()))

    async def run():
        await engine.start()
        held = asyncio.create_task(handler.create(CompletionRequest(
            prompt="Hi", max_tokens=1, request_id="held", structured_outputs={"choice": ["a", "b"]})))
        await asyncio.sleep(0.05)  # the held request is in its check
        plain = asyncio.create_task(handler.create(CompletionRequest(prompt="Once", max_tokens=1, request_id="plain")))
        await answer("cmpl-plain")
        responses = [await plain]
        order.append("plain answered")
        release.set()
        await answer("cmpl-held")
        responses.append(await held)
        await engine.shutdown()
        return responses

    plain, held = asyncio.run(run())
    assert order == ["plain answered", "check"]
    assert plain.status_code == 200 and held.status_code == 200
    assert json.loads(held.body)["choices"][0]["finish_reason"] == "length"
