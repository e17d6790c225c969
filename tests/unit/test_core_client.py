"""EngineCoreClient under back-pressure: a full input queue is a 429, never an exception that
becomes a 500, and an abort that meets it is retried until sent (no model, no core process)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq

from tandem.engine.core_client import EngineCoreClient
from tandem.engine.core_proc import AbortRequests, InputMessage
from tandem.errors import EngineRequestError
from tandem.request import Request
from tandem.sampling_params import SamplingParams, StructuredOutputsParams


class FakeProc:
    pid = 12345
    exitcode = None

    def is_alive(self) -> bool:
        return True


@pytest.fixture
def client(tmp_path):
    """A client whose input socket has no core connected yet: every send meets a full queue."""
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PUSH)
    inputs.setsockopt(zmq.LINGER, 0)
    inputs.bind(f"ipc://{tmp_path}/input")
    outputs = ctx.socket(zmq.PULL)
    outputs.bind(f"ipc://{tmp_path}/output")
    c = EngineCoreClient(FakeProc(), ctx, inputs, outputs, str(tmp_path))
    yield c
    for sock in (inputs, outputs):
        sock.close(linger=0)
    ctx.term()


def request(rid: str) -> Request:
    return Request(request_id=rid, prompt_token_ids=[1, 2], sampling_params=SamplingParams(max_tokens=2),
                   eos_token_ids=frozenset(), max_tokens=2)


def test_add_on_a_full_queue_is_429_with_retry_after(client):
    with pytest.raises(EngineRequestError) as info:
        client.add_requests("r1", [request("r1")])
    assert info.value.status == 429
    assert info.value.message == "the engine core is busy (its input queue is full); retry later"
    assert info.value.retry_after == 1.0


def test_an_add_the_core_cannot_decode_is_400_and_never_sent(client):
    """A field of the wrong type past the front end's checks stopped the core (its decoder is strict)."""
    params = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="a"))
    params.structured_outputs.disable_any_whitespace = "yes"
    req = Request(request_id="r1", prompt_token_ids=[1, 2], sampling_params=params, eos_token_ids=frozenset(),
                  max_tokens=2)
    with pytest.raises(EngineRequestError) as info:
        client.add_requests("r1", [req])
    assert info.value.status == 400
    assert info.value.message == ("the request has a field of the wrong type: Expected `bool`, got `str` - at "
                                  "`$.requests[0].sampling_params.structured_outputs.disable_any_whitespace`")


def test_abort_on_a_full_queue_is_kept_and_sent_once_the_core_reads(client, tmp_path):
    async def run() -> list:
        client.abort_requests(["a", "b"])  # no core: the queue is "full"
        client.abort_requests(["c"])
        assert client.num_pending_aborts == 3
        peer = client.ctx.socket(zmq.PULL)
        peer.connect(f"ipc://{tmp_path}/input")
        try:
            deadline = asyncio.get_running_loop().time() + 5
            while client.num_pending_aborts and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)  # the retry timer sends them
            assert peer.poll(2000)
            decoder = msgspec.msgpack.Decoder(InputMessage)
            return [decoder.decode(peer.recv())]
        finally:
            peer.close(linger=0)

    messages = asyncio.run(run())
    assert messages == [AbortRequests(["a", "b", "c"])]
    assert client.num_pending_aborts == 0


def test_core_proc_reports_a_failed_step_and_keeps_serving(tmp_path):
    from tandem.engine.core_proc import EngineCoreProc, StepFailed, StepOutputs
    from tandem.errors import EngineStepError

    class FailingCore:
        def __init__(self) -> None:
            self.aborted: list[str] = []

        def step(self):
            try:
                raise RuntimeError("boom")
            except RuntimeError as e:
                raise EngineStepError(["a"]) from e

        def abort_requests(self, ids):
            self.aborted.extend(ids)

    class Outputs:
        def __init__(self) -> None:
            self.sent: list = []

    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    try:
        proc = EngineCoreProc(FailingCore(), inputs, Outputs(), 0, 0)
        proc.send = proc.outputs.sent.append
        proc.live = {"a": request("a")}
        proc.step()
        assert proc.outputs.sent == [StepFailed(["a"], "RuntimeError: boom")]
        assert proc.core.aborted == ["a"] and proc.live == {}
        assert not any(isinstance(m, StepOutputs) for m in proc.outputs.sent)
    finally:
        inputs.close(linger=0)
        ctx.term()
