"""Findings of the API trial (structured output, tools, prompt logprobs), without a server: regex
classes as ECMAScript defines them, regexes that match nothing, unknown ``structured_outputs`` keys,
tool schemas, ``parallel_tool_calls`` under "auto", a prompt-only request in the scheduler, the
warning for a chat template that ignores tools, completions ``text_offset`` of an echoed prompt."""

from __future__ import annotations

import logging

import llguidance
import pytest
from test_scheduler import FakeRunner, make_request, make_scheduler, step
from transformers import AutoTokenizer

from tandem.engine.processor import InputProcessor, check_context
from tandem.errors import ContextLengthExceededError
from tandem.outputs import Logprob
from tandem.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from tandem.server.logprobs import completion_logprobs, echo_offsets
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest
from tandem.server.tools import ToolCalling, extract_calls
from tandem.structured_outputs import _byte_tokenizer, check_grammar, ecmascript_classes, grammar_text

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def accepts(params: StructuredOutputsParams, text: str) -> bool:
    """Whether the grammar takes ``text`` whole (byte by byte) and may end there."""
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar_text(params), log_level=0)
    return all(matcher.consume_token(b) for b in text.encode()) and matcher.is_accepting()


def test_d_and_w_are_ascii_as_in_ecmascript_and_xgrammar():
    assert ecmascript_classes(r"\d+[\d\w-]\\d\D\W\s") == r"[0-9]+[[0-9][A-Za-z0-9_]-]\\d[^0-9][^A-Za-z0-9_]\s"
    assert accepts(StructuredOutputsParams(regex=r"\d+"), "2026")
    assert not accepts(StructuredOutputsParams(regex=r"\d+"), "\u0663")  # ARABIC-INDIC DIGIT THREE
    assert not accepts(StructuredOutputsParams(regex=r"\w"), "\u00e9")
    assert accepts(StructuredOutputsParams(regex=r"[\d]x\s"), "7x\u00a0")  # \s stays Unicode (ECMAScript)
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": r"^\d{2}$"},
                                               "const": {"const": r"\d"}},
              "required": ["code"], "additionalProperties": False}
    json_params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    assert accepts(json_params, '{"code":"42"}')
    assert not accepts(json_params, '{"code":"4\u0663"}')
    assert accepts(json_params, '{"code":"42","const":"\\\\d"}')  # a const is data, kept as written


@pytest.mark.parametrize("constraint, message", [
    ({"regex": "[a-b&&c]"}, "the regex '[a-b&&c]' cannot be enforced: it matches no text"),
    ({"regex": r"a[^\s\S]"}, r"the regex 'a[^\\s\\S]' cannot be enforced: it matches no text"),
    ({"grammar": r'start: /[^\s\S]/ "x"'}, "the grammar cannot be enforced: it matches no text"),
])
def test_a_regex_or_grammar_that_matches_nothing_is_refused(constraint, message):
    with pytest.raises(SamplingParamsError) as info:
        check_grammar(StructuredOutputsParams(**constraint), None, "structured_outputs")
    assert (str(info.value), info.value.param) == (message, "structured_outputs")
    check_grammar(StructuredOutputsParams(regex=r"a|[^\s\S]"))  # one branch matches: fine
    check_grammar(StructuredOutputsParams(regex="x{0}"))  # the empty text is a match


def test_unknown_structured_outputs_key_is_named():
    expected = ("structured_outputs has no field 'regexx'; its fields are json, regex, choice, grammar, "
                "json_object, disable_any_whitespace")
    with pytest.raises(SamplingParamsError) as info:
        CompletionRequest(prompt="x", structured_outputs={"regexx": "a"}).sampling_params(SamplingParams())
    assert (str(info.value), info.value.param) == (expected, "structured_outputs")
    with pytest.raises(SamplingParamsError, match="no field 'bogus'"):
        SamplingParams(structured_outputs={"regex": "a", "bogus": 1})


@pytest.mark.parametrize("choice", ["none", "auto", None])
def test_tool_parameters_must_be_a_json_schema_whatever_the_choice(choice):
    tools = [TOOL, {"type": "function", "function": {"name": "g", "parameters": {"type": "objectx"}}}]
    with pytest.raises(SamplingParamsError) as info:
        ToolCalling(True, "hermes").plan(tools, choice, None)
    assert info.value.param == "tools.1.function.parameters"
    assert str(info.value).startswith("the parameters of tool 'g' are not a valid JSON Schema: 'objectx' is not")
    ToolCalling(True, "hermes").plan([TOOL, {"type": "function", "function": {"name": "h"}}], choice, None)


def test_auto_keeps_one_call_without_parallel_tool_calls_and_undeclared_names():
    text = ('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "not_declared", "arguments": {"x": 1}}</tool_call>')
    calling = ToolCalling(True, "hermes")
    _, calls = extract_calls(calling.plan([TOOL], "auto", None), text)
    assert [c.name for c in calls] == ["f", "not_declared"]  # vLLM's parsers do not filter names either
    _, calls = extract_calls(calling.plan([TOOL], "auto", False), text)
    assert [c.name for c in calls] == ["f"]  # vLLM PR 26233: the first call, the rest dropped


def test_a_prompt_only_request_fills_the_context_and_ends_without_a_token():
    sched = make_scheduler(max_model_len=12)
    sched.add_request(make_request("p", 12, max_tokens=0, prompt_logprobs=0))
    runner = FakeRunner()
    outputs = []
    while sched.has_unfinished_requests():
        outputs += step(sched, runner)[1]
    (out,) = outputs
    assert (out.new_token_ids, out.finish_reason) == ([], "length")
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):  # 0 without prompt logprobs
        make_scheduler().add_request(make_request("q", 3, max_tokens=0))
    check_context(12, 12, 0)
    with pytest.raises(ContextLengthExceededError):
        check_context(12, 12, None)
    with pytest.raises(SamplingParamsError, match="max_tokens must be at least 1, got 0"):
        SamplingParams(max_tokens=0)
    params = CompletionRequest(prompt="x", echo=True, max_tokens=0).sampling_params(SamplingParams())
    assert (params.max_tokens, params.prompt_logprobs) == (0, 0)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_tokens=0, prompt_logprobs=1)
    with pytest.raises(SamplingParamsError, match="max_tokens must be at least 1, got 0"):
        chat.sampling_params(SamplingParams())


def test_a_chat_template_that_ignores_tools_is_a_warning_once(stories_dir, caplog):
    tokenizer = AutoTokenizer.from_pretrained(str(stories_dir))
    ignores = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    renders = "{% for t in tools or [] %}{{ t.function.name }};{% endfor %}" + ignores
    messages = [{"role": "user", "content": "Hi"}]
    for template, warnings in ((renders, 0), (ignores, 1)):
        processor = InputProcessor(tokenizer, 512, 512, frozenset({2}), chat_template=template)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tandem.engine.processor"):
            for _ in range(3):
                processor.apply_chat_template(messages, tools=[TOOL])
            processor.apply_chat_template(messages)
        assert [r.getMessage().startswith("the chat template ignores `tools`") for r in caplog.records] == \
            [True] * warnings


def test_text_offset_of_an_echoed_text_prompt_indexes_the_text(stories_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(stories_dir))
    prompt = "Once upon a time"
    ids = tokenizer(prompt)["input_ids"]
    offsets = echo_offsets(tokenizer, prompt, ids)
    assert offsets == ([0, 0, 4, 9, 11], len(prompt))  # "<s>" is zero-length; " upon" starts at its space
    generated = tokenizer(",", add_special_tokens=False)["input_ids"][-1:]
    positions = [None] + [{t: Logprob(-1.0, 1, None)} for t in ids[1:] + generated]
    out, end = completion_logprobs(tokenizer, ids + generated, positions, 0, 0, offsets)
    text = prompt + tokenizer.decode(generated)
    assert out.text_offset == [0, 0, 4, 9, 11, 16] and end == len(text)
    assert [text[a:b] for a, b in zip(out.text_offset, out.text_offset[1:] + [end], strict=True)] == \
        ["", "Once", " upon", " a", " time", ","]
