"""Tool calling through the official `openai` client, with a Hermes-style chat template written here:
named and "required" choices are grammar-constrained, so even stories260K's gibberish comes back as
calls whose arguments validate against the tool's schema; a full round trip (call, tool result, answer)
streams and not; the prompt is the template's rendering of the tools and the history."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from live_server import Server
from transformers import AutoTokenizer

HERMES = (
    # NOTE: stories260K has a 512-token context and about one token per character: the tools are
    # rendered as signatures, not as their full JSON.
    "{%- if tools %}<|im_start|>system\n<tools>"
    "{%- for tool in tools %}\n{{ tool.function.name }}({{ tool.function.parameters.properties | join(',') }})"
    "{%- endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{%- for call in message.tool_calls %}\n<tool_call>{{ {'name': call.function.name, "
    "'arguments': call.function.arguments} | tojson }}</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>{{ message.content }}"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tool_server(stories_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools")
    template = folder / "hermes.jinja"
    template.write_text(HERMES)
    server = Server(stories_dir, folder / "server.log", "--chat-template", str(template), "--served-model-name",
                    "m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    try:
        server.wait_healthy(timeout_s=300.0)  # NOTE: a loaded CI machine starts servers slowly
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    finally:
        assert server.stop() == 0, server.log()


def prompt_tokens(stories_dir, messages, tools=None) -> int:
    tokenizer = AutoTokenizer.from_pretrained(str(stories_dir))
    text = tokenizer.apply_chat_template(messages, tools=tools, chat_template=HERMES, tokenize=False,
                                         add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_named_and_required_calls_validate_against_the_tool_schema(tool_server, stories_dir):
    out = tool_server.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=NAMED, n=8,
                                              temperature=1.0, seed=0, max_tokens=80)
    for choice in out.choices:
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
        assert choice.message.content is None and choice.finish_reason == "stop"
    assert out.usage.prompt_tokens == prompt_tokens(stories_dir, ASK, TOOLS)  # the template rendered the tools
    out = tool_server.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required", n=8,
                                              temperature=1.0, seed=0, max_tokens=120, parallel_tool_calls=False)
    names = set()
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        names.add(call.function.name)
    assert names <= set(SCHEMAS)


@pytest.mark.parametrize("stream", [False, True])
def test_round_trip_call_result_answer(tool_server, stories_dir, stream):
    first = tool_server.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                                temperature=1.0, seed=3, max_tokens=80)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    kwargs = {"model": "m", "messages": history, "tools": TOOLS, "temperature": 0.0, "max_tokens": 12}
    if not stream:
        answer = tool_server.chat.completions.create(**kwargs, tool_choice="none")
        assert answer.choices[0].message.content and answer.choices[0].message.tool_calls == []
        expected = [{**m, "tool_calls": [{**c, "function": {**c["function"],
                                                             "arguments": json.loads(c["function"]["arguments"])}}
                                         for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in history]
        assert answer.usage.prompt_tokens == prompt_tokens(stories_dir, expected, TOOLS)
        return
    chunks = list(tool_server.chat.completions.create(**kwargs, tool_choice="none", stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = list(tool_server.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                                     temperature=1.0, seed=5, max_tokens=120, stream=True,
                                                     parallel_tool_calls=False))
    deltas = [d for c in calls for d in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and calls[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in calls)
    jsonschema.validate(json.loads(deltas[0].function.arguments), SCHEMAS[deltas[0].function.name])


def test_auto_without_a_call_is_text_and_bad_tool_requests_are_400(tool_server):
    out = tool_server.chat.completions.create(model="m", messages=ASK, tools=TOOLS, temperature=0.0, max_tokens=8)
    assert out.choices[0].message.content and out.choices[0].message.tool_calls == []  # gibberish, no call
    assert out.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as info:
        tool_server.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=8,
                                            tool_choice={"type": "function", "function": {"name": "nope"}})
    assert info.value.body["param"] == "tool_choice"
    assert info.value.body["message"] == "tool_choice names the function 'nope', which is not in tools"
    with pytest.raises(openai.BadRequestError) as info:
        tool_server.chat.completions.create(model="m", messages=ASK, tool_choice="required", max_tokens=8)
    assert info.value.body["message"] == "When using `tool_choice`, `tools` must be set."
    bad = [*TOOLS, {"type": "function", "function": {"name": "broken", "parameters": {"type": "objectx"}}}]
    with pytest.raises(openai.BadRequestError) as info:  # under "auto" too, not only required / named
        tool_server.chat.completions.create(model="m", messages=ASK, tools=bad, max_tokens=8)
    assert info.value.body["param"] == "tools.2.function.parameters"
    assert info.value.body["message"].startswith("the parameters of tool 'broken' are not a valid JSON Schema")
    unique = [{"type": "function", "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}}}]
    with pytest.raises(openai.BadRequestError) as info:  # the handler's llguidance check names "tools"
        tool_server.chat.completions.create(model="m", messages=ASK, tools=unique, max_tokens=8,
                                            tool_choice={"type": "function", "function": {"name": "f"}})
    assert info.value.body == {"message": 'the JSON schema cannot be enforced: Unimplemented keys: ["uniqueItems"]',
                               "type": "invalid_request_error", "param": "tools", "code": None}
