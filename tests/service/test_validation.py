"""Request validation on the shared live server: every user mistake is a 400 (never a 500) with an
exact OpenAI error body, plus the model routes, HEAD /health and the key check before the body."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from live_server import AUTH, MODEL
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def server(api_server):
    return api_server


@pytest.fixture(scope="module")
def tokenizer(stories_dir):
    return AutoTokenizer.from_pretrained(str(stories_dir))


def error(param, message, code=None, type_="invalid_request_error"):
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def post(server, path, body, headers=AUTH):
    if isinstance(body, str):  # raw JSON text (NaN, Infinity, \ud800 escapes)
        return httpx.post(f"{server.url}{path}", content=body, timeout=60,
                          headers={**headers, "Content-Type": "application/json"})
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


CMPL = '{"model": "stories", "prompt": "Hi", "max_tokens": 4, '
CHAT = '{"model": "stories", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, '
LE = "Input should be less than or equal to"


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 100000000000000000000000}', "max_tokens",
     f"max_tokens: {LE} 2147483647"),
    ("/v1/completions", CMPL + '"seed": 100000000000000000000000000}', "seed", f"seed: {LE} 9223372036854775807"),
    ("/v1/completions", CMPL + '"seed": -9223372036854775809}', "seed",
     "seed: Input should be greater than or equal to -9223372036854775808"),
    ("/v1/completions", CMPL + '"seed": 18446744073709551615, "n": 2}', "seed", f"seed: {LE} 9223372036854775807"),
    ("/v1/completions", CMPL + '"min_tokens": 18446744073709551616}', "min_tokens", f"min_tokens: {LE} 2147483647"),
    ("/v1/completions", CMPL + '"stop_token_ids": [100000000000000000000000]}', "stop_token_ids",
     f"stop_token_ids.0: {LE} 2147483647"),
    ("/v1/completions", CMPL + '"stop_token_ids": [-1]}', "stop_token_ids",
     "stop_token_ids.0: Input should be greater than or equal to 0"),
    ("/v1/completions", CMPL + '"top_k": 100000000000000000000000}', "top_k", f"top_k: {LE} 2147483647"),
    ("/v1/chat/completions", CHAT + '"max_completion_tokens": 100000000000000000000000}', "max_completion_tokens",
     f"max_completion_tokens: {LE} 2147483647"),
    ("/v1/completions", CMPL + '"n": 129}', "n", f"n: {LE} 128"),
    ("/v1/completions", CMPL + '"kv_transfer_params": {"a": [100000000000000000000000]}}', "kv_transfer_params",
     "kv_transfer_params: can't serialize ints < -2**63 or > 2**64 - 1"),
    ("/v1/chat/completions", CHAT + '"n": 129}', "n", f"n: {LE} 128"),
    # Strings that are not Unicode (lone UTF-16 surrogates) in every place a string reaches.
    ("/v1/completions", '{"prompt": "\\ud800 hi", "max_tokens": 4}', "prompt",
     "prompt: the string is not valid Unicode (lone surrogate U+D800)"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages",
     "messages: the string is not valid Unicode (lone surrogate U+DFFF)"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages", "messages: the string is not valid Unicode (lone surrogate U+D800)"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt", "prompt: the string is not valid Unicode (lone surrogate U+D800)"),
    ("/v1/completions", CMPL + '"stop": ["\\ud800"]}', "stop",
     "stop: the string is not valid Unicode (lone surrogate U+D800)"),
    ("/v1/completions", CMPL + '"stop": "\\ud83d", "stream": true}', "stop",
     "stop: the string is not valid Unicode (lone surrogate U+D83D)"),
    ("/v1/completions", CMPL + '"user": "\\udc00"}', "user",
     "user: the string is not valid Unicode (lone surrogate U+DC00)"),
    # Papercuts.
    ("/v1/completions", CMPL + '"stop": ""}', "stop", "stop strings must be non-empty"),
    ("/v1/completions", CMPL + '"stop": [""]}', "stop", "stop strings must be non-empty"),
    # Stop strings are matched per decoded token in the front end: their count and length are bounded.
    ("/v1/completions", CMPL + '"stop": [' + ", ".join(f'"s{i}"' for i in range(65)) + "]}", "stop",
     "at most 64 stop strings are allowed, got 65"),
    ("/v1/chat/completions", CHAT + '"stop": [' + ", ".join(f'"zz{i:05}"' for i in range(10000)) + "]}", "stop",
     "at most 64 stop strings are allowed, got 10000"),
    ("/v1/chat/completions", CHAT + '"stop": "' + "x" * 257 + '"}', "stop",
     "a stop string may have at most 256 characters, got 257"),
    ("/v1/completions", CMPL + '"temperature": Infinity}', "temperature",
     "temperature: Input should be a finite number"),
    ("/v1/chat/completions", CHAT + '"top_p": NaN}', "top_p", "top_p: Input should be a finite number"),
    ("/v1/completions", '{"prompt": [true, false]}', "prompt",
     "prompt: Input should be one of: str, list[str], list[int], list[list[int]]"),
    ("/detokenize", '{"tokens": [true]}', "tokens", "tokens.0: Input should be a valid integer"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": 5}]}', "messages",
     "messages.0.content: Input should be one of: str, list[dict[str,any]]"),
    ("/v1/chat/completions", CHAT + '"max_completion_tokens": 0}', "max_completion_tokens",
     "max_completion_tokens must be at least 1, got 0"),
    ("/v1/completions", CMPL + '"logprobs": 21}', "logprobs", f"logprobs: {LE} 20"),
    ("/v1/completions", CMPL + '"prompt_logprobs": -1}', "prompt_logprobs",
     "prompt_logprobs: Input should be greater than or equal to 0"),
    ("/v1/chat/completions", CHAT + '"logprobs": true, "top_logprobs": 21}', "top_logprobs", f"top_logprobs: {LE} 20"),
])
def test_invalid_values_are_400_not_500(server, path, body, param, message):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json() == error(param, message)


def test_limits_at_the_bounds_are_accepted(server):
    # The full signed 64-bit seed range; children of n > 1 take seed + i wrapped into it.
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "n": 128, "seed": 2**63 - 1, "temperature": 1.0}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == list(range(128))
    r = post(server, "/v1/completions", {**body, "n": 1, "seed": -(2**63), "stop_token_ids": [511]})
    assert r.status_code == 200, r.text
    r = post(server, "/v1/completions", {**body, "n": 1, "stop": [f"{i:03}" + "x" * 253 for i in range(64)]})
    assert r.status_code == 200, r.text
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                              "max_tokens": 1, "seed": 2**63 - 1})
    assert r.status_code == 200, r.text


def test_explicit_max_tokens_beyond_the_context_is_400(server, tokenizer):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 510})
    message = ("This model's maximum context length is 512 tokens. However, you requested 513 tokens "
               "(3 in the prompt, 510 in the completion). Please reduce the length of the prompt or completion.")
    assert r.status_code == 400 and r.json() == error("prompt", message, "context_length_exceeded")
    assert post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 509}).status_code == 200
    messages = [{"role": "user", "content": "Tell me a story"}]
    n_prompt = len(post(server, "/tokenize", {"messages": messages}).json()["tokens"])
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_completion_tokens": 500})
    message = (f"This model's maximum context length is 512 tokens. However, you requested {n_prompt + 500} tokens "
               f"({n_prompt} in the messages, 500 in the completion). Please reduce the length of the messages or "
               "completion.")
    assert r.status_code == 400 and r.json() == error("messages", message, "context_length_exceeded")


def test_prompt_too_long_in_characters_is_400_before_tokenizing(server):
    # stories260K: longest vocabulary entry 7 characters, no normalizer that shrinks text: 512 * 7.
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "a" * 3585, "max_tokens": 1})
    message = ("This model's maximum context length is 512 tokens. However, the prompt has 3585 characters, more "
               "than the 3584 that 512 tokens can hold with this tokenizer. Please reduce the length of the prompt.")
    assert r.status_code == 400 and r.json() == error("prompt", message, "context_length_exceeded")
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a" * 4000}]})
    n_chars = 4000 + len("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n")
    message = (f"This model's maximum context length is 512 tokens. However, the messages have {n_chars} characters, "
               "more than the 3584 that 512 tokens can hold with this tokenizer. Please reduce the length of the "
               "messages.")
    assert r.status_code == 400 and r.json() == error("messages", message, "context_length_exceeded")


def test_prompt_that_fills_the_context_is_400_naming_the_field(server):
    # The same fault, the same words for both endpoints; only the field differs.
    for path, body, param in (("/v1/completions", {"prompt": [5] * 600}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a " * 600}]},
                               "messages")):
        r = post(server, path, {"model": MODEL, **body, "max_tokens": 4})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert message.startswith("This model's maximum context length is 512 tokens. However, you requested ")
        assert message.endswith(f" tokens in the {param}, which leaves no room for the completion. Please reduce "
                                f"the length of the {param}.")
        assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == "context_length_exceeded"


def test_tokenizing_a_huge_prompt_does_not_block_the_event_loop(server):
    # /tokenize has no length limit: 1.2 M characters take the tokenizer thread a second or more.
    result = {}

    def tokenize():
        result["response"] = post(server, "/tokenize", {"prompt": "Once upon a time " * 70000})

    worker = threading.Thread(target=tokenize)
    worker.start()
    time.sleep(0.2)
    health = httpx.get(f"{server.url}/health", timeout=30)
    answered_during_tokenization = worker.is_alive()
    worker.join(60)
    assert health.status_code == 200
    # BOS, four tokens per "Once upon a time", and the trailing space on its own.
    assert result["response"].status_code == 200 and result["response"].json()["count"] == 1 + 4 * 70000 + 1
    assert answered_during_tokenization, "/health waited for the tokenizer"


def test_key_is_checked_before_the_body(server):
    for headers in ({"Authorization": "Bearer nope"}, {}):
        r = post(server, "/v1/completions", "{not json", headers=headers)
        assert r.status_code == 401
        assert r.json() == error(None, "Incorrect API key provided.", "invalid_api_key")
    r = post(server, "/v1/completions", "{not json")
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("the request body is not valid JSON")


def test_retrieve_model_and_head_health(server):
    for name in (MODEL, "stories-alias"):
        r = httpx.get(f"{server.url}/v1/models/{name}", headers=AUTH, timeout=10)
        card = r.json()
        assert r.status_code == 200 and card["id"] == name and card["object"] == "model"
        assert card["owned_by"] == "tandem" and card["max_model_len"] == 512 and isinstance(card["created"], int)
    r = httpx.get(f"{server.url}/v1/models/gpt-4", headers=AUTH, timeout=10)
    assert r.status_code == 404
    assert r.json() == error("model", "The model `gpt-4` does not exist or you do not have access to it.",
                             "model_not_found")
    assert httpx.get(f"{server.url}/v1/models/{MODEL}", timeout=10).status_code == 401
    r = httpx.head(f"{server.url}/health", timeout=10)
    assert r.status_code == 200 and r.content == b""


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {"prompt": "Hi", "guided_json": {"type": "object"}}, "guided_json",
     "guided_json is not supported"),
    ("/v1/completions", {"prompt": "Hi", "guided_regex": "a+"}, "guided_regex", "guided_regex is not supported"),
    ("/v1/chat/completions", {"guided_choice": ["a", "b"]}, "guided_choice", "guided_choice is not supported"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice",
     '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format",
     "response_format of type 'json_schema' needs json_schema.schema"),
    # vLLM's extras a migrating client sends: refused unless honoured.
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search",
     "use_beam_search is not supported (Tandem has no beam search)"),
    ("/v1/chat/completions", {"length_penalty": 0.5}, "length_penalty",
     "length_penalty is not supported (it applies to beam search only)"),
    ("/v1/completions", {"cache_salt": "tenant-a"}, "cache_salt", "cache_salt is not supported"),
    ("/v1/chat/completions", {"cache_salt": "tenant-a"}, "cache_salt", "cache_salt is not supported"),
    ("/v1/completions", {"prompt_embeds": "AAAA"}, "prompt_embeds", "prompt_embeds is not supported"),
    ("/v1/chat/completions", {"vllm_xargs": {"k": 1}}, "vllm_xargs", "vllm_xargs is not supported"),
    ("/v1/completions", {"return_token_ids": True, "echo": True}, "return_token_ids",
     "return_token_ids is not supported with echo"),
    ("/v1/completions", {"priority": "x"}, "priority", "priority: Input should be a valid integer"),
    ("/v1/completions", {"priority": []}, "priority", "priority: Input should be a valid integer"),
    ("/v1/chat/completions", {"priority": {}}, "priority", "priority: Input should be a valid integer"),
    ("/v1/chat/completions", {"priority": 1.5}, "priority", "priority: Input should be a valid integer"),
    ("/v1/completions", {"priority": True}, "priority", "priority: Input should be a valid integer"),
    # The shared server schedules by longest prefix hit (lpm, the default): an order it would not give is
    # refused, as vLLM does.
    ("/v1/completions", {"priority": 5}, None,
     "Got priority 5 but priority scheduling is not enabled (this server's --scheduling-policy is lpm)"),
    ("/v1/chat/completions", {"priority": -1}, None,
     "Got priority -1 but priority scheduling is not enabled (this server's --scheduling-policy is lpm)"),
])
def test_fields_tandem_does_not_honour_are_refused(server, path, body, param, message):
    base = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    r = post(server, path, {"model": MODEL, **base, "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json() == error(param, message)


def test_fields_that_change_nothing_are_accepted(server):
    messages = [{"role": "user", "content": "Hi"}]
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2,
                                              "tool_choice": "none", "parallel_tool_calls": None,
                                              "response_format": {"type": "text"}, "guided_json": None})
    assert r.status_code == 200, r.text
    # vLLM's defaults of the extras refused above change nothing either.
    defaults = {"priority": 0, "use_beam_search": False, "length_penalty": 1.0, "cache_salt": None,
                "prompt_embeds": None, "vllm_xargs": None, "return_token_ids": False}
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **defaults, "stream": True,
                                         "stream_options": {"include_usage": True, "continuous_usage_stats": False}})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text


@pytest.mark.parametrize("path, param", [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")])
def test_empty_body_names_the_required_field(server, path, param):
    r = httpx.post(f"{server.url}{path}", headers=AUTH, timeout=10)
    assert r.status_code == 400
    assert r.json() == error(param, f"the request body must be a JSON object with the field {param!r}")
