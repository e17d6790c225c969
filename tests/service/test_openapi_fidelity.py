"""``/openapi.json`` says what the server does: 400 (never 422) with OpenAI's error body, the statuses and
content types each route really answers, the bearer key, token-id bounds; plus the service-route shapes
(``/tokenizer_info``, ``/health``, ``/metrics``) and JSON bodies sent with another Content-Type."""

from __future__ import annotations

import httpx
import pytest
from live_server import AUTH, MODEL


@pytest.fixture(scope="module")
def server(api_server):
    return api_server


@pytest.fixture(scope="module")
def spec(server):
    r = httpx.get(f"{server.url}/openapi.json", timeout=30)
    assert r.status_code == 200
    return r.json()


def media(response: httpx.Response) -> str | None:
    value = response.headers.get("content-type")
    return None if value is None else value.split(";")[0]


def check_documented(spec, path, method, response):
    """The status is documented for the route, with this content type and (for errors) OpenAI's body."""
    documented = spec["paths"][path][method]["responses"]
    assert str(response.status_code) in documented, (path, response.status_code, response.text)
    content = documented[str(response.status_code)].get("content", {})
    assert (media(response) in content) if content else not response.content, (path, media(response))
    if response.status_code >= 400:
        assert content["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_no_422_and_the_key_is_documented(spec):
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            assert "422" not in operation["responses"], (path, method)
            assert ("security" in operation) == path.startswith("/v1/"), (path, method)
            if path.startswith("/v1/"):
                assert "401" in operation["responses"]
    assert spec["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    prompt = spec["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert prompt[2]["items"] == {"type": "integer", "minimum": 0, "maximum": 511}  # the vocabulary
    seed = spec["components"]["schemas"]["CompletionRequest"]["properties"]["seed"]["anyOf"][0]
    assert (seed["minimum"], seed["maximum"]) == (-(2**63), 2**63 - 1)


@pytest.mark.parametrize("method, path, body, headers, status", [
    ("post", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}, AUTH, 200),
    ("post", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": True}, AUTH, 200),
    ("post", "/v1/completions", {"model": MODEL, "prompt": "Hi", "temperature": -1}, AUTH, 400),
    ("post", "/v1/completions", {"prompt": "Hi"}, {}, 401),
    ("post", "/v1/completions", {"model": "nope", "prompt": "Hi"}, AUTH, 404),
    ("post", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                      "stream": True}, AUTH, 200),
    ("post", "/v1/chat/completions", {"messages": []}, AUTH, 400),
    ("get", "/v1/models", None, AUTH, 200),
    ("get", "/v1/models/nope", None, AUTH, 404),
    ("get", "/health", None, {}, 200),
    ("head", "/health", None, {}, 200),
    ("get", "/metrics", None, {}, 200),
    ("get", "/version", None, {}, 200),
    ("get", "/tokenizer_info", None, {}, 200),
    ("post", "/tokenize", {"prompt": "Hi"}, {}, 200),
    ("post", "/tokenize", {}, {}, 400),
    ("post", "/detokenize", {"tokens": [1, 403]}, {}, 200),
    ("post", "/detokenize", {"tokens": [512]}, {}, 400),
])
def test_real_responses_match_the_document(server, spec, method, path, body, headers, status):
    r = httpx.request(method.upper(), f"{server.url}{path}", json=body, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    documented_path = "/v1/models/{model_id}" if path.startswith("/v1/models/") else path
    check_documented(spec, documented_path, method, r)


def test_405_lists_the_allowed_methods(server):
    r = httpx.delete(f"{server.url}/tokenize", timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["message"] == "Method Not Allowed"


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_json_body_with_another_content_type_is_read_as_json(server, content_type):
    headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
    r = httpx.post(f"{server.url}/v1/completions", content=f'{{"model": "{MODEL}", "prompt": "Hi", "max_tokens": 1}}',
                   headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    bad = httpx.post(f"{server.url}/v1/completions", content="prompt=Hi", headers=headers, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("the request body is not valid JSON")


def test_service_route_shapes(server, stories_dir):
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.content == b"" and "content-type" not in health.headers
    metrics = httpx.get(f"{server.url}/metrics", timeout=10)
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    info = httpx.get(f"{server.url}/tokenizer_info", timeout=10).json()
    from transformers import AutoTokenizer

    assert info["tokenizer_class"] == type(AutoTokenizer.from_pretrained(str(stories_dir))).__name__
    assert info["bos_token"] == "<s>" and "vocab_file" not in info and "tokenizer_file" not in info
    assert info["chat_template"].startswith("{% for message in messages %}")  # the --chat-template in use
