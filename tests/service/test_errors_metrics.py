"""Error statuses with their OpenAI JSON bodies, the service endpoints, /metrics, and disconnects."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import openai
import pytest
from live_server import API_KEY, AUTH, MODEL, metric_samples, wait_idle
from transformers import AutoTokenizer

from tandem.kernels import registry


@pytest.fixture(scope="module")
def server(api_server):
    return api_server


@pytest.fixture(scope="module")
def tokenizer(stories_dir):
    return AutoTokenizer.from_pretrained(str(stories_dir))


def post(server, path, body, headers=AUTH, timeout=60.0):
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=timeout)


def error(param, message, code=None, type_="invalid_request_error"):
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# ---- errors ----
def test_prompt_longer_than_context_is_400(server):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": [5] * 600, "max_tokens": 4})
    assert r.status_code == 400
    message = ("This model's maximum context length is 512 tokens. However, you requested 600 tokens in the "
               "prompt, which leaves no room for the completion. Please reduce the length of the prompt.")
    assert r.json() == error("prompt", message, "context_length_exceeded")


@pytest.mark.parametrize("field, value, param, message", [
    ("temperature", -1.0, "temperature", "temperature must be >= 0, got -1.0"),
    ("top_p", 1.5, "top_p", "top_p must be in (0, 1], got 1.5"),
    ("max_tokens", -5, "max_tokens", "max_tokens must be at least 1, got -5"),
    ("n", 0, "n", "n must be at least 1, got 0"),
])
def test_bad_sampling_values_are_400(server, field, value, param, message):
    for path, body in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        r = post(server, path, {"model": MODEL, **body, field: value})
        assert r.status_code == 400, r.text
        assert r.json() == error(param, message)


def test_wrong_types_and_unsupported_fields_are_400(server):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "temperature": "hot"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                              "response_format": {"type": "xml"}})
    assert r.status_code == 400
    assert r.json() == error("response_format", "response_format type must be 'text', 'json_object' or "
                             "'json_schema', got 'xml'")
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json() == error("messages", "messages must not be empty")
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": ""})
    assert r.status_code == 400 and r.json() == error("prompt", "the prompt is empty")
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": [1, 9999]})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "token id 9999 is out of the vocabulary [0, 512)"


def test_wrong_or_missing_key_is_401(server):
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert info.value.status_code == 401
    expected = error(None, "Incorrect API key provided.", "invalid_api_key")
    for headers in ({}, {"Authorization": "Bearer nope"}):
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi"}, headers=headers)
        assert r.status_code == 401 and r.json() == expected
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401


def test_unknown_model_is_404(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "Hi"}])
    r = post(server, "/v1/completions", {"model": "gpt-4", "prompt": "Hi"})
    assert r.status_code == 404
    assert r.json() == error("model", "The model `gpt-4` does not exist or you do not have access to it.",
                             "model_not_found")


# ---- service endpoints ----
def test_health_version_models(server):
    r = httpx.get(f"{server.url}/health", timeout=10)
    assert r.status_code == 200 and r.content == b""
    version = httpx.get(f"{server.url}/version", timeout=10).json()
    assert version == {"version": "0.1.0", "kernel_backend": version["kernel_backend"]}
    # the engine core's kernel path: the same as this process selects (the same CPU and environment)
    assert version["kernel_backend"] == registry.selected()
    log = server.log()  # the core's start-up line, and the front end's ready line
    assert f"Tandem kernels: {version['kernel_backend']}" in log and f"kernels {version['kernel_backend']});" in log
    models = httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=10).json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL, "stories-alias"]
    assert all(m["object"] == "model" and m["max_model_len"] == 512 for m in models["data"])
    alias = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0).completions.create(
        model="stories-alias", prompt="Hi", max_tokens=2)
    assert alias.model == "stories-alias"


def test_tokenize_detokenize(server, tokenizer):
    r = post(server, "/tokenize", {"prompt": "Once upon a time"})
    expected = {"count": 5, "max_model_len": 512, "tokens": [1, 403, 407, 261, 378], "token_strs": None}
    assert r.json() == expected
    r = post(server, "/tokenize", {"prompt": "Once upon a time", "add_special_tokens": False})
    assert r.json()["tokens"] == [403, 407, 261, 378]
    r = post(server, "/detokenize", {"tokens": [403, 407, 261, 378]})
    assert r.json() == {"prompt": tokenizer.decode([403, 407, 261, 378])} == {"prompt": "Once upon a time"}
    r = post(server, "/detokenize", {"tokens": [600]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


# ---- metrics ----
NAMES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
         "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
         "request_success_total", "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
         "e2e_request_latency_seconds_count", "request_queue_time_seconds_count",
         "iteration_tokens_total_count"]


def _delta(after, before, name, **labels):
    key = (f"tandem:{name}", tuple(sorted(labels.items())))
    return after[key] - before.get(key, 0.0)


def test_metrics_parse_and_count_requests(server):
    before = wait_idle(server.url)
    for n in NAMES:
        assert any(k[0] == f"tandem:{n}" for k in before), n
    assert before[("process_resident_memory_bytes", ())] > 0
    assert before[("tandem:engine_core_resident_memory_bytes", ())] > 0
    info = {k: v for k, v in before.items() if k[0] == "tandem:kernel_backend_info"}
    assert info == {("tandem:kernel_backend_info", (("backend", registry.selected()),)): 1.0}
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    for max_tokens in (3, 5, 7):
        client.completions.create(model=MODEL, prompt=[1, 403, 407], max_tokens=max_tokens, temperature=0,
                                  extra_body={"ignore_eos": True})
    client.completions.create(model=MODEL, prompt=[1, 274, 287, 269], max_tokens=4, n=2, seed=0,
                              extra_body={"ignore_eos": True})
    after = wait_idle(server.url)
    assert _delta(after, before, "request_success_total", finished_reason="length") == 5
    assert _delta(after, before, "request_success_total", finished_reason="stop") == 0
    assert _delta(after, before, "prompt_tokens_total") == 3 * 3 + 2 * 4
    assert _delta(after, before, "generation_tokens_total") == 3 + 5 + 7 + 2 * 4
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert _delta(after, before, f"{hist}_count") == 5
    assert _delta(after, before, "inter_token_latency_seconds_count") == 2 + 4 + 6 + 2 * 3
    assert _delta(after, before, "prefix_cache_queries_total") > 0
    # Tokens computed: each prompt, then every output token but the last one (short prompts: no hits).
    assert _delta(after, before, "iteration_tokens_total_sum") == (3 + 2) + (3 + 4) + (3 + 6) + 2 * (4 + 3)


# ---- disconnects ----
def test_stream_disconnect_aborts_and_frees_kv(server):
    before = wait_idle(server.url)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 480, "stream": True,
            "ignore_eos": True, "temperature": 0}
    seen = 0
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                assert json.loads(line[6:])["choices"][0]["finish_reason"] is None
                seen += 1
                if seen == 3:
                    break
    after = wait_idle(server.url)
    assert after[("tandem:kv_cache_usage_perc", ())] == 0
    assert after[("tandem:num_requests_running", ())] == 0
    assert _delta(after, before, "request_success_total", finished_reason="length") == 0
    # vLLM counts an aborted request under finished_reason="abort" and in the e2e latency histogram.
    assert _delta(after, before, "request_success_total", finished_reason="abort") == 1
    assert _delta(after, before, "e2e_request_latency_seconds_count") == 1
    assert _delta(after, before, "generation_tokens_total") < 480
    assert _abort_logged(server)


def test_non_stream_disconnect_aborts(server):
    before = wait_idle(server.url)
    body = json.dumps({"model": MODEL, "prompt": [1] + [400] * 20, "max_tokens": 490, "ignore_eos": True})
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}")
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(request.encode())
        deadline = time.monotonic() + 10
        while metric_samples(server.url)[("tandem:num_requests_running", ())] < 1:
            assert time.monotonic() < deadline, "the request never started running"
            time.sleep(0.01)
    after = wait_idle(server.url)
    assert after[("tandem:kv_cache_usage_perc", ())] == 0
    assert _delta(after, before, "request_success_total", finished_reason="length") == 0
    assert _delta(after, before, "request_success_total", finished_reason="abort") == 1
    assert _delta(after, before, "generation_tokens_total") < 490


def _abort_logged(server, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    pattern = re.compile(r"finished request cmpl-\w+: prompt_tokens=5 output_tokens=\d+ ttft=\S+ "
                         r"total=\S+ finish_reason=abort")
    while time.monotonic() < deadline:
        if pattern.search(server.log()):
            return True
        time.sleep(0.1)
    return False
