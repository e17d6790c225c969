"""Structured output in the offline API: greedy output under a grammar is the same with and without
speculation (n-gram and a draft model) and inside a mixed batch; a bad schema raises before anything
is queued."""

from __future__ import annotations

import json
import threading

import pytest

from tandem import LLM, SamplingParams, StructuredOutputsParams
from tandem.errors import EngineRequestError
from tandem.sampling_params import SamplingParamsError

SCHEMA = {"type": "object", "properties": {"who": {"type": "string", "maxLength": 10},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["who", "n"], "additionalProperties": False}
PROMPTS = ['Once upon a time {"who": "Lily", "n": 3} and {"who": "Tom", "n": 5}', "The dog"]


def greedy(schema: dict) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema))


@pytest.fixture(scope="module")
def plain(stories_dir):
    return LLM(str(stories_dir), dtype="float32", progress=False, num_threads=1)


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3},
                                  {"method": "draft", "num_speculative_tokens": 3, "speculative_model": "ar"}])
def test_greedy_grammar_output_does_not_depend_on_speculation_or_batch(plain, stories_dir, spec):
    if "speculative_model" in spec:
        spec = {**spec, "speculative_model": str(stories_dir.parent / "drafts" / "ar")}
    expected = [o.outputs[0].text for o in plain.generate(PROMPTS, greedy(SCHEMA))]
    for text in expected:
        assert set(json.loads(text)) == {"who", "n"}
    speculating = LLM(str(stories_dir), dtype="float32", progress=False, num_threads=1, speculative_config=spec)
    mixed = speculating.generate(PROMPTS + ["Once"], [greedy(SCHEMA), greedy(SCHEMA), SamplingParams(max_tokens=20)])
    assert [o.outputs[0].text for o in mixed[:2]] == expected
    assert mixed[0].outputs[0].num_draft_tokens > 0


def test_unsupported_schema_raises_before_queueing(plain):
    with pytest.raises(SamplingParamsError, match=r'Unimplemented keys: \["uniqueItems"\]'):
        plain.generate("Once", [greedy({"type": "array", "uniqueItems": True})])
    assert not plain.engine.has_unfinished_requests()


def test_a_grammar_beyond_llguidance_limits_raises_and_frees_its_blocks(plain):
    """``a{500000}`` passes the edge's check, then its first token exceeds llguidance's lexer limit:
    the call raises (never unconstrained text), the batch's other request ends too, no block is held."""
    limit = SamplingParams(temperature=0.0, max_tokens=8,
                           structured_outputs=StructuredOutputsParams(regex="a{500000}"))
    with pytest.raises(EngineRequestError) as info:
        plain.generate(["Once", "The dog"], [limit, SamplingParams(max_tokens=8)])
    assert info.value.status == 400
    assert info.value.message == ("the structured output constraint could not be enforced: "
                                  "lexer error: too many expressions constructed")
    assert not plain.engine.has_unfinished_requests()
    assert plain.engine.scheduler.kv_cache_manager.usage == 0
    plain.engine.scheduler.check()
    assert plain.generate("Once", SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0].token_ids


def test_an_aborted_request_cancels_its_grammar_compile_not_yet_started(plain):
    """A request aborted while its grammar waits for the compile thread does not leave the compile
    queued (behind it the grammars of requests still waiting would wait too), at once: with no
    request left no engine step runs."""
    engine, gate = plain.engine, threading.Event()
    busy = engine.runner.grammars._pool.submit(gate.wait, 30)  # NOTE: the single compile thread, held
    digits = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[0-9]{3}"))
    request = plain.processor.make_requests("gone", [1, 403], digits)[0]
    engine.add_request(request)
    future = engine.runner._pending_grammars[request.request_id]
    engine.abort_requests([request.request_id])
    assert future.cancelled() and not engine.has_unfinished_requests()
    gate.set()
    assert busy.result() is True
    assert plain.generate("Once", digits)[0].outputs[0].text.isdigit()
    assert request.request_id not in engine.runner._pending_grammars  # dropped at that step
