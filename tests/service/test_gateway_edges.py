"""`tandem gateway` on loopback against scripted backends only (no model): the status endpoints'
key, secrets kept out of status and /metrics, backend names in the gateway's own errors, and
model names mapped back in answers."""

from __future__ import annotations

import base64
import json

import httpx
import openai
import pytest
from faulty_backend import FaultyBackend, ThreadServer

from tandem.gateway.app import build_gateway_app
from tandem.gateway.config import BackendConfig, CanaryConfig, FallbackConfig, GatewayConfig

GW_KEY, SECRET = "gw-client-key", "backend-secret"


@pytest.fixture
def backends():
    primary, candidate = FaultyBackend("primary-model"), FaultyBackend("candidate-model")
    with ThreadServer(primary.app) as p, ThreadServer(candidate.app) as c:
        primary.url, candidate.url = p.url, c.url
        yield primary, candidate


def _gateway(backends, **changes) -> ThreadServer:
    primary, candidate = backends
    # NOTE: the candidate's URL carries userinfo (a credential httpx sends as Basic auth)
    config = GatewayConfig(
        primary=BackendConfig("primary", primary.url, SECRET, {"stories": "primary-model"}),
        candidate=BackendConfig("candidate", candidate.url.replace("://", f"://ops:{SECRET}@"), None,
                                {"stories": "candidate-model"}),
        api_key=GW_KEY, **changes)
    return ThreadServer(build_gateway_app(config))


def _basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_status_needs_the_key_and_nothing_shows_secrets(backends):
    with _gateway(backends) as gw:
        for path, challenge in (("/gateway/status", "Bearer"), ("/gateway/", 'Basic realm="tandem gateway"')):
            refused = ({}, {"Authorization": "Bearer wrong"}, _basic("admin", "wrong"), {"Authorization": "Basic !"})
            for headers in refused:
                r = httpx.get(f"{gw.url}{path}", headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
                assert r.headers["www-authenticate"].startswith(challenge)
        status = httpx.get(f"{gw.url}/gateway/status", headers={"Authorization": f"Bearer {GW_KEY}"})
        page = httpx.get(f"{gw.url}/gateway/", headers=_basic("anyone", GW_KEY))
        assert status.status_code == page.status_code == 200
        assert status.json()["backends"]["candidate"]["url"] == backends[1].url.replace("://", "://***@")
        # /metrics stays open, as vLLM leaves it with --api-key; it holds no URL and no key
        metrics = httpx.get(f"{gw.url}/metrics")
        assert metrics.status_code == 200 and "tandem_gateway_requests" in metrics.text
        for text in (status.text, page.text, metrics.text):
            assert SECRET not in text and GW_KEY not in text
        assert "127.0.0.1" not in metrics.text


def test_answers_carry_the_client_model_name(backends):
    with _gateway(backends, canary=CanaryConfig(weight=1.0)) as gw:
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=GW_KEY, max_retries=0)
        raw = client.completions.with_raw_response.create(model="stories", prompt="x", max_tokens=3)
        assert raw.headers["x-tandem-backend"] == "candidate" and raw.parse().model == "stories"
        seen = backends[1].requests[-1]
        assert seen["body"]["model"] == "candidate-model"
        assert seen["headers"]["authorization"] == "Basic " + base64.b64encode(f"ops:{SECRET}".encode()).decode()
        chunks = list(client.completions.create(model="stories", prompt="x", max_tokens=3, stream=True))
        assert [c.model for c in chunks] == ["stories"] * 3
        assert "".join(c.choices[0].text for c in chunks) == "Once upon a time"
        # the gateway asked for usage the client did not; the client sees no usage chunk
        assert backends[1].requests[-1]["body"]["stream_options"] == {"include_usage": True}
        assert all(c.usage is None for c in chunks)
        status = httpx.get(f"{gw.url}/gateway/status", headers={"Authorization": f"Bearer {GW_KEY}"}).json()
        assert status["totals"]["completion_tokens"] == 6 and status["totals"]["prompt_tokens"] == 4
        # the model list (from the primary) names the client's model, not the primary's own name
        assert [m.id for m in client.models.list()] == ["stories"]
        assert client.models.retrieve("stories").id == "stories"


def test_gateway_errors_name_the_backend(backends):
    primary, candidate = backends
    primary.mode = candidate.mode = "error"
    fallback = FallbackConfig(breaker_failures=1, breaker_cooldown_s=60)
    with _gateway(backends, canary=CanaryConfig(weight=1.0), fallback=fallback) as gw:
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=GW_KEY, max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:  # both answered 500: the last one is relayed
            client.completions.create(model="stories", prompt="x", max_tokens=1)
        assert e.value.response.headers["x-tandem-backend"] == "primary"
        assert e.value.body["message"] == "planted failure"
        with pytest.raises(openai.APIStatusError) as e:  # both breakers are open now
            client.completions.create(model="stories", prompt="x", max_tokens=1)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "60"
        assert e.value.body["message"] == ("every backend's circuit breaker is open (candidate: circuit breaker "
                                           "open; primary: circuit breaker open)")
        assert SECRET not in json.dumps(e.value.body)


def test_connect_error_names_the_backend_not_its_credentials(backends):
    primary, _ = backends
    dead = BackendConfig("candidate", f"http://ops:{SECRET}@127.0.0.1:9")
    config = GatewayConfig(primary=BackendConfig("primary", "http://127.0.0.1:9"), candidate=dead, api_key=GW_KEY,
                           canary=CanaryConfig(weight=1.0))
    with ThreadServer(build_gateway_app(config)) as gw:
        r = httpx.post(f"{gw.url}/v1/completions", json={"model": "m", "prompt": "x"},
                       headers={"Authorization": f"Bearer {GW_KEY}"})
    error = r.json()["error"]
    assert r.status_code == 502 and error["code"] == "connect_error"
    assert error["message"].startswith("no backend answered (candidate: ConnectError: ")
    assert "; primary: ConnectError: " in error["message"] and SECRET not in r.text
