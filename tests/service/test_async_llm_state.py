"""AsyncLLM's bookkeeping without a core process: a fake client records what would be sent, so each
failure path can be driven by hand (encoding errors, cancellation, abort, core death, shutdown)."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
from transformers import AutoTokenizer

from tandem.engine.async_llm import AsyncLLM, EngineDeadError
from tandem.engine.core_proc import AddResult, CoreStats
from tandem.engine.loading import Frontend
from tandem.engine.processor import max_prompt_chars
from tandem.models.hf_config import load_hf_config
from tandem.sampling_params import SamplingParams


class FakeClient:
    """Stands in for EngineCoreClient: records adds and aborts; ``fail_send`` makes sends raise."""

    max_model_len = 512
    pid = None

    def __init__(self, fail_send: Exception | None = None) -> None:
        self.fail_send = fail_send
        self.added: list[str] = []
        self.aborted: list[str] = []

    def add_requests(self, parent_id, requests):
        if self.fail_send is not None:
            raise self.fail_send
        self.added.append(parent_id)

    def abort_requests(self, request_ids):
        self.aborted.extend(request_ids)

    def is_alive(self):
        return True


class FakeMetrics:
    def __init__(self) -> None:
        self.finished: list[str] = []
        self.cleared = 0

    def record_finished(self, finish_reason, e2e):
        assert e2e >= 0
        self.finished.append(finish_reason)

    def clear_gauges(self):
        self.cleared += 1


@pytest.fixture(scope="module")
def frontend(stories_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(stories_dir))
    return Frontend(stories_dir, load_hf_config(stories_dir), tokenizer, SamplingParams(), None)


def make(frontend, client):
    metrics = FakeMetrics()
    return AsyncLLM(frontend, client, metrics), metrics


PARAMS = SamplingParams(n=2, max_tokens=4)


def test_a_send_that_fails_leaves_no_state(frontend):
    # e.g. msgspec's OverflowError / UnicodeEncodeError on a value the protocol let through.
    engine, metrics = make(frontend, FakeClient(fail_send=OverflowError("int too big to convert")))
    with pytest.raises(OverflowError):
        asyncio.run(engine.add_request("r1", None, [1, 2, 3], PARAMS))
    assert engine._parents == {} and engine._children == {}
    assert metrics.finished == []


def test_refused_request_leaves_no_state_and_counts_nothing(frontend):
    client = FakeClient()
    engine, metrics = make(frontend, client)

    async def run():
        task = asyncio.create_task(engine.add_request("r1", None, [1, 2, 3], PARAMS))
        await asyncio.sleep(0)
        engine._on_add_result(AddResult("r1", 429, "the waiting queue is full"))
        return await asyncio.gather(task, return_exceptions=True)

    (result,) = asyncio.run(run())
    assert result.status == 429
    assert engine._parents == {} and metrics.finished == []


def test_cancel_while_queued_and_abort_count_as_abort(frontend, caplog):
    client = FakeClient()
    engine, metrics = make(frontend, client)

    async def run():
        task = asyncio.create_task(engine.add_request("r1", None, [1, 2, 3], PARAMS))
        await asyncio.sleep(0)
        task.cancel()  # the client went away before the core answered
        await asyncio.gather(task, return_exceptions=True)
        task = asyncio.create_task(engine.add_request("r2", None, [1, 2, 3], PARAMS))
        await asyncio.sleep(0)
        engine._on_add_result(AddResult("r2", 200))
        stream = await task
        stream.abort()
        stream.abort()  # idempotent: counted once

    with caplog.at_level(logging.INFO, logger="tandem.requests"):
        asyncio.run(run())
    assert client.aborted == ["0_r1", "1_r1", "0_r2", "1_r2"]
    assert metrics.finished == ["abort"] * 4
    assert engine._parents == {} and engine._children == {}
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("finished request")]
    assert [line.split(":")[0] for line in lines] == ["finished request r1", "finished request r2"]
    assert all(line.endswith("finish_reason=abort,abort") for line in lines)


def test_core_death_and_shutdown_deadline_end_everything(frontend, caplog):
    engine, metrics = make(frontend, FakeClient())
    engine.last_stats = CoreStats(num_running=1, num_waiting=1, kv_cache_usage=0.5)

    async def run():
        accepted = asyncio.create_task(engine.add_request("a", None, [1, 2, 3], PARAMS))
        pending = asyncio.create_task(engine.add_request("p", None, [1, 2], SamplingParams(max_tokens=4)))
        await asyncio.sleep(0)
        engine._on_add_result(AddResult("a", 200))
        stream = await accepted
        assert engine.end_all("the server is shutting down") == 2
        with pytest.raises(EngineDeadError, match="the server is shutting down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError, match="the server is shutting down"):
            await pending
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", None, [1, 2], SamplingParams(max_tokens=4))

    with caplog.at_level(logging.INFO, logger="tandem.requests"):
        asyncio.run(run())
    assert metrics.cleared == 1 and engine.last_stats == CoreStats()
    assert sorted(metrics.finished) == ["abort"] * 3
    assert sorted(engine.client.aborted) == ["0_a", "1_a", "p"]
    assert engine._parents == {} and engine._children == {}
    finished = sorted(r.getMessage().split(":")[0] for r in caplog.records if "finished request" in r.getMessage())
    assert finished == ["finished request a", "finished request p"]


def test_tokenizer_work_runs_off_the_event_loop(frontend):
    engine, _ = make(frontend, FakeClient())

    async def run():
        return await engine.run_in_tokenizer(lambda: threading.current_thread().name)

    assert asyncio.run(run()).startswith("tandem-tokenizer")


def test_prompt_character_bound_never_rejects_a_prompt_that_fits(frontend):
    tokenizer = frontend.tokenizer
    limit = max_prompt_chars(tokenizer, 512)
    assert limit == 512 * 7  # the longest entries ("▁little", "▁friend") are 7 characters
    # The longest prompt that fits (BOS + 510 tokens, one short of the context): 7 characters a token.
    longest = "little" + " little" * 509
    assert len(tokenizer(longest)["input_ids"]) == 511 and len(longest) == 3569 <= limit


def test_prompt_character_bound_is_off_when_the_tokenizer_drops_text(frontend):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def wrap(tok):
        return PreTrainedTokenizerFast(tokenizer_object=tok)

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()  # spaces vanish: no bound
    assert max_prompt_chars(wrap(words), 512) is None
    bpe = Tokenizer(models.BPE({"a": 0, "<unk>": 1}, [], unk_token="<unk>", fuse_unk=True))
    assert max_prompt_chars(wrap(bpe), 512) is None  # a run of unknown characters is one token
    bpe = Tokenizer(models.BPE({"a": 0, "aa": 1, "<unk>": 2}, [("a", "a")], unk_token="<unk>"))
    bpe.normalizer = normalizers.NFC()
    assert max_prompt_chars(wrap(bpe), 512) == 512 * 5 * 4  # "<unk>", and NFC composes up to 4 into 1
