"""Structured output through the official `openai` client: stories260K writes gibberish, so every valid
JSON document, regex match and choice below is the grammar's doing. The same requests run on a server
with n-gram speculation, whose drafts must be checked against the grammar."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from live_server import API_KEY, AUTH, MODEL, Server, metric_samples, sse_data, wait_idle

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog", "owl"]},
                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3}},
            "required": ["kind", "tags"],
            "additionalProperties": False,
        },
        "happy": {"type": "boolean"},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
PROMPT = 'Once upon a time {"name": "Tim", "age": 3, "pet": {"kind": "dog", "tags": ["big"]}}'


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module", params=["plain", "ngram"])
def client(request, stories_dir, chat_template_file, tmp_path_factory):
    """plain: the session's ``api_server`` (ChatML, the API key, served as ``stories``; it exits 0 at the end of
    the session, see conftest.py); ngram: a server of the same flags plus n-gram speculation."""
    if request.param == "plain":
        server = request.getfixturevalue("api_server")
        yield _client(server), server
        return
    server = Server(stories_dir, tmp_path_factory.mktemp("so") / "server.log", "--chat-template",
                    str(chat_template_file), "--api-key", API_KEY, "--served-model-name", MODEL,
                    "--speculative-method", "ngram", "--num-speculative-tokens", "3")
    try:
        server.wait_healthy(timeout_s=300.0)  # NOTE: a loaded CI machine starts servers slowly
        yield _client(server), server
    finally:
        assert server.stop() == 0, server.log()


def test_json_schema_holds_for_20_sampled_requests(client):
    api, server = client
    out = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, temperature=1.0, seed=0, n=20,
                                 extra_body={"response_format": JSON_SCHEMA_FORMAT})
    for choice in out.choices:  # n = 20: child i is seeded 0 + i
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    assert len({c.text for c in out.choices}) > 10  # sampled, not one forced string
    if "--speculative-method" in server.proc.args:
        m = metric_samples(server.url)
        assert m[("tandem:spec_decode_num_accepted_tokens_total", ())] > 0  # drafts ran under the grammar


_JSON_TAILS = ["", "0", "null", ":null", "ue", "lse", "ll", "e0", "]", "}"]


def completes_to_json(text: str) -> bool:
    """True if ``text`` is a prefix of a JSON document: closing its open string, a few tails and its
    open brackets makes it parse (an independent check of what the grammar promised)."""
    stack, in_string, escaped = [], False, False
    for ch in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]":
            stack.pop()
    closers = "".join(reversed(stack))
    body = text + ('"' if in_string else "")
    for head in (body, body.rstrip().rstrip(",")):
        for tail in _JSON_TAILS:
            try:
                json.loads(head + tail + closers)
                return True
            except ValueError:
                continue
    return False


def test_json_object_output_is_an_object_or_its_prefix(client):
    """stories260K never ends a free-form object on its own (it keeps adding keys), so the completions cut
    at max_tokens must be prefixes of a JSON object, and the ones that stop must parse."""
    api, _ = client
    out = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}],
                                      max_tokens=40, temperature=1.0, seed=0, n=10,
                                      response_format={"type": "json_object"})
    for choice in out.choices:
        text = choice.message.content
        assert text.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert choice.finish_reason == "length" and completes_to_json(text), text
    out = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=200,
                                      temperature=1.0, seed=1, response_format=JSON_SCHEMA_FORMAT)
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    assert not completes_to_json('{"a": tru e}') and completes_to_json('{"a": [1, {"b": "x')


def test_regex_and_choice_always_match(client):
    api, _ = client
    pattern = r"[a-z]{2,5}-[0-9]{1,3}( [A-Z][a-z]{0,4}){1,2}"
    out = api.completions.create(model=MODEL, prompt="Once upon", max_tokens=40, temperature=1.0, seed=0, n=8,
                                 extra_body={"structured_outputs": {"regex": pattern}})
    for choice in out.choices:
        assert re.fullmatch(pattern, choice.text) and choice.finish_reason == "stop", choice.text
    choices = ["yes", "no", "the little dog"]
    out = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=20,
                                      temperature=1.0, seed=0, n=8, extra_body={"structured_outputs":
                                                                               {"choice": choices}})
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in out.choices)
    assert len({c.message.content for c in out.choices}) > 1
    out = api.completions.create(model=MODEL, prompt="Once", max_tokens=30, temperature=0.0,
                                 extra_body={"structured_outputs": {"grammar": 'start: "a" ("b" | "c")+ "."'}})
    assert re.fullmatch(r"a[bc]+\.", out.choices[0].text)


def test_stream_of_a_constrained_completion_joins_to_valid_json(client):
    api, _ = client
    stream = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, temperature=1.0, seed=7, stream=True,
                                    extra_body={"response_format": JSON_SCHEMA_FORMAT})
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in chunks)), SCHEMA)


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format",
     'the JSON schema cannot be enforced: Unimplemented keys: ["uniqueItems"]'),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"not": {"type": "null"}}}}}},
     "structured_outputs", 'the JSON schema cannot be enforced: Unimplemented keys: ["not"]'),
    ({"response_format": {"type": "json_schema"}}, "response_format",
     "response_format of type 'json_schema' needs json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format",
     "response_format type must be 'text', 'json_object' or 'json_schema', got 'yaml'"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "structured_outputs needs exactly one of json, regex, choice, grammar, json_object; got regex, choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "give response_format or structured_outputs, not both"),
    ({"structured_outputs": {"regex": "[^\\s\\S]"}}, "structured_outputs",
     "the regex '[^\\\\s\\\\S]' cannot be enforced: it matches no text"),
    ({"structured_outputs": {"regexx": "a"}}, "structured_outputs", "structured_outputs has no field 'regexx'; its "
     "fields are json, regex, choice, grammar, json_object, disable_any_whitespace"),
    # NOTE: these two reached the engine core, whose strict decoder then stopped it (a 503, and a crash loop)
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": "yes"}},
     "structured_outputs.disable_any_whitespace", "structured_outputs.disable_any_whitespace has the wrong type"),
    ({"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object",
     "structured_outputs.json_object has the wrong type"),
])
def test_constraints_the_engine_cannot_honour_are_400(client, body, param, message):
    _, server = client
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4, **body}, headers=AUTH,
                   timeout=30)
    assert r.status_code == 400
    assert r.json() == {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                  "code": None}}


LIMIT_ERROR = {"error": {"message": "the structured output constraint could not be enforced: lexer error: too many "
                         "expressions constructed", "type": "invalid_request_error", "param": None, "code": None}}


def test_a_grammar_beyond_llguidance_limits_is_an_error_not_free_text(client):
    """``a{500000}`` passes the edge's check; its first token exceeds llguidance's lexer limit in the
    engine, which ends the request with an error (its KV blocks freed) instead of unconstrained text."""
    _, server = client
    body = {"prompt": "Once upon a time", "max_tokens": 8, "structured_outputs": {"regex": "a{500000}"}}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400 and r.json() == LIMIT_ERROR
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=60) as r:
        assert r.status_code == 200  # NOTE: the header went out before the engine found the limit
        data = sse_data(r)
    assert data[-1] == "[DONE]" and [json.loads(d) for d in data[:-1]] == [LIMIT_ERROR]
    idle = wait_idle(server.url)
    assert idle[("tandem:kv_cache_usage_perc", ())] == 0 and idle[("tandem:num_requests_running", ())] == 0
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Once", "max_tokens": 2}, headers=AUTH,
                  timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2  # the engine serves on
    assert "integrity check failed" not in server.log()
