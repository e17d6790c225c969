"""Tool-call parsers and the streaming splitter on hand-written model outputs, malformed ones included
(returned as text, never an exception); tool_choice planning with vLLM's rules."""

from __future__ import annotations

import json

import pytest

from tandem.sampling_params import SamplingParamsError
from tandem.server.tool_parsers import HermesParser, Llama3JsonParser, PythonicParser
from tandem.server.tools import AUTO_NEEDS_FLAGS, ToolCalling, ToolCallStream, extract_calls, finish_reason
from tandem.structured_outputs import check_grammar

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def calls_of(parsed):
    content, calls = parsed
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris"})]),
    ('Let me look.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
     '{"x": [1, 2]}}</tool_call>', "Let me look.", [("a", {}), ("b", {"x": [1, 2]})]),
    ('<tool_call>{"name": "a", "arguments": "{\\"k\\": 1}"}', None, [("a", {"k": 1})]),  # unterminated, string args
    ("Just text, no call.", "Just text, no call.", []),
    ('<tool_call>{"name": "a", "arguments": {</tool_call>', None, []),  # broken JSON
    ('<tool_call>["a"]</tool_call>', None, []),
    ('<tool_call>{"arguments": {}}</tool_call>', None, []),  # no name
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call> and then some prose', None, []),
])
def test_hermes(text, content, calls):
    got_content, got_calls = calls_of(HermesParser().parse(text))
    assert got_calls == calls
    assert got_content == (content if calls else text)


@pytest.mark.parametrize("text, calls", [
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', [("get_weather", {"city": "Oslo"})]),
    ('<|python_tag|>{"name": "a", "arguments": {"n": 1}}; {"name": "b", "parameters": {}}', [("a", {"n": 1}),
                                                                                            ("b", {})]),
    ("The weather is fine.", []),
    ('{"name": "a", "parameters": {"n": 1}', []),  # truncated
    ('{"name": 3, "parameters": {}}', []),
    ('{"name": "a", "parameters": {}} trailing words', []),
])
def test_llama3_json(text, calls):
    content, got = calls_of(Llama3JsonParser().parse(text))
    assert got == calls and content == (None if calls else text)


@pytest.mark.parametrize("text, calls", [
    ('[get_weather(city="Rome"), ping()]', [("get_weather", {"city": "Rome"}), ("ping", {})]),
    ("[f(a=1, b=[1, 2], c={'k': None}, d=True)]", [("f", {"a": 1, "b": [1, 2], "c": {"k": None}, "d": True})]),
    ("[f(1)]", []),  # positional arguments have no names
    ("[f(a=g())]", []),  # not a literal
    ("[f(**kw)]", []),
    ("[f(a=1)", []),
    ("[]", []),
    ("no calls here", []),
    ("[x.y(a=1)]", []),
])
def test_pythonic(text, calls):
    content, got = calls_of(PythonicParser().parse(text))
    assert got == calls and content == (None if calls else text)


def test_stream_sends_content_before_a_call_and_holds_a_partial_tag():
    plan = ToolCalling(True, "hermes").plan([WEATHER], "auto", None)
    s = ToolCallStream(plan)
    assert s.feed("Sure, ") == "Sure, "
    assert s.feed("one <tool") == "one "  # "<tool" may open a call: held
    assert s.feed("box> is") == "<toolbox> is"  # it did not
    assert s.feed(' <tool_call>{"name": "get_weather", ') == " "
    assert s.feed('"arguments": {"city": "Rome"}}</tool_call>') == ""
    rest, calls = s.finish()
    assert rest == "" and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Rome"})]
    assert calls[0]["index"] == 0 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    broken = ToolCallStream(plan)
    assert broken.feed("Hi <tool_call>{oops") == "Hi "
    assert broken.finish() == ("<tool_call>{oops", [])  # malformed: the held text goes out as content


def test_plans_follow_vllm():
    plain, auto = ToolCalling(), ToolCalling(True, "hermes")
    assert plain.plan(None, None, None).mode == "none" and plain.plan([WEATHER], "none", None).mode == "none"
    for tool_choice in (None, "auto"):  # absent means auto when tools are given
        with pytest.raises(SamplingParamsError, match='"auto" tool choice requires') as info:
            plain.plan([WEATHER], tool_choice, None)
        assert str(info.value) == AUTO_NEEDS_FLAGS and info.value.param == "tool_choice"
    assert auto.plan([WEATHER], None, None).mode == "auto"
    with pytest.raises(SamplingParamsError, match="`tools` must be set"):
        plain.plan(None, "required", None)
    with pytest.raises(SamplingParamsError, match="'nope', which is not in tools"):
        plain.plan([WEATHER], {"type": "function", "function": {"name": "nope"}}, None)
    with pytest.raises(SamplingParamsError, match='tool_choice must be "none"'):
        plain.plan([WEATHER], "always", None)
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}}}
    bad_plan = plain.plan([bad], {"type": "function", "function": {"name": "f"}}, None)
    with pytest.raises(SamplingParamsError, match=r'Unimplemented keys: \["uniqueItems"\]') as info:
        check_grammar(bad_plan.constraint, None, "tools")  # NOTE: the handler's check, off the event loop
    assert info.value.param == "tools"
    required = plain.plan([WEATHER], "required", False)
    assert required.constraint.json["maxItems"] == 1
    content, calls = extract_calls(required, '[{"name": "get_weather", "parameters": {"city": "Rome"}}]')
    assert content is None and calls[0].name == "get_weather"
    assert finish_reason(required, calls, "stop") == "tool_calls"
    assert finish_reason(required, calls, "length") == "length"
    named = plain.plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named.constraint.json == WEATHER["function"]["parameters"]
    content, calls = extract_calls(named, '{"city": "Rome"}')
    assert calls[0].arguments == '{"city": "Rome"}' and finish_reason(named, calls, "stop") == "stop"
    assert extract_calls(named, '{"city": "Ro') == ('{"city": "Ro', [])  # cut by max_tokens: text
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ToolCalling(True, None)


DEEP = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize("parser, text", [
    (HermesParser(), '<tool_call>{"name": "a", "arguments": ' + DEEP + "}</tool_call>"),
    (HermesParser(), '<tool_call>{"name": "a", "arguments": "' + DEEP + '"}</tool_call>'),
    (Llama3JsonParser(), '{"name": "a", "parameters": ' + DEEP + "}"),
])
def test_too_deeply_nested_output_comes_back_as_text(parser, text):
    assert parser.parse(text) == (text, [])
