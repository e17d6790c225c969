"""The one-slot output collector (no model): deltas merge while the reader lags, cumulative outputs
replace each other, an error wins and stays."""

from __future__ import annotations

import asyncio

from tandem.engine.request_stream import OutputCollector
from tandem.errors import EngineDeadError
from tandem.outputs import CompletionOutput, Logprob, RequestOutput


def output(text: str, ids: list[int], finish: str | None = None, index: int = 0) -> RequestOutput:
    c = CompletionOutput(index=index, text=text, token_ids=ids, cumulative_logprob=None,
                         logprobs=[{i: Logprob(-1.0, 1)} for i in ids], finish_reason=finish)
    return RequestOutput("r", None, [1], [c], finished=finish is not None)


def test_deltas_merge_into_one_pending_output():
    async def run():
        collector = OutputCollector(delta=True)
        collector.put(output(" Once", [403]))
        collector.put(output(" upon", [407], index=1))
        collector.put(output(" a", [261], finish="length"))
        return await collector.get()

    merged = asyncio.run(run())
    assert merged.finished
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in merged.outputs] == [
        (0, " Once a", [403, 261], "length"), (1, " upon", [407], None)]
    assert [list(p) for p in merged.outputs[0].logprobs] == [[403], [261]]


def test_cumulative_outputs_replace_and_an_error_stays():
    async def run():
        collector = OutputCollector(delta=False)
        collector.put(output(" Once", [403]))
        collector.put(output(" Once upon", [403, 407]))
        latest = await collector.get()
        collector.put(EngineDeadError("the engine core process died"))
        collector.put(output(" Once upon a", [403, 407, 261]))
        return latest, await collector.get(), await collector.get()

    latest, error, again = asyncio.run(run())
    assert latest.outputs[0].text == " Once upon"
    assert isinstance(error, EngineDeadError) and error is again
