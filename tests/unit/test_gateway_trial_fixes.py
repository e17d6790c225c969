"""Regressions from the fresh-user trial of the migration toolkit (issue 14), without a model."""

from __future__ import annotations

import functools

import httpx

from tandem.cli import main

KEYED_GATEWAY_STATUS = {"backends": {"primary": {"url": "http://p", "breaker": {"state": "closed"}}},
                        "canary": {"weights": {"primary": 1.0, "candidate": 0.0}, "rolled_back": False},
                        "events": []}


def _keyed_gateway(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/metrics":
        return httpx.Response(200, text="")
    if request.url.path == "/gateway/status":
        return httpx.Response(200, json=KEYED_GATEWAY_STATUS)
    if request.headers.get("authorization") != "Bearer right":
        return httpx.Response(401, json={"error": {"message": "bad key", "type": "invalid_request_error",
                                                   "param": None, "code": "invalid_api_key"}})
    return httpx.Response(200, json={"object": "list", "data": []})


def test_drill_without_key_on_a_keyed_gateway_is_a_clear_error(monkeypatch, capsys):
    transport = httpx.MockTransport(_keyed_gateway)
    monkeypatch.setattr(httpx, "AsyncClient", functools.partial(httpx.AsyncClient, transport=transport))
    monkeypatch.delenv("TANDEM_GATEWAY_API_KEY", raising=False)
    assert main(["drill", "--gateway", "http://gw", "--candidate-stop", "true"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem: error: http://gw/v1/models answered 401") and "pass --api-key" in err
    assert main(["drill", "--gateway", "http://gw", "--candidate-stop", "true", "--api-key", "wrong"]) == 2
    assert "the key given by --api-key was refused" in capsys.readouterr().err
    # Right key but no models listed: a clear error too, not an IndexError.
    assert main(["drill", "--gateway", "http://gw", "--candidate-stop", "true", "--api-key", "right"]) == 2
    assert "without a model list; pass --model" in capsys.readouterr().err


def test_bench_environment_redacts_secret_flags_and_variables(monkeypatch):
    from tandem.bench.environment import collect_environment

    monkeypatch.setenv("TANDEM_KV_SECRET", "s3cret")
    monkeypatch.setenv("TANDEM_GATEWAY_API_KEY", "ka")
    monkeypatch.setenv("TANDEM_MAX_TOKENS", "16")
    argv = ["tandem", "bench", "serve", "--api-key", "ka", "--hf-token=hf_x", "--max-tokens", "16",
            "--tokenizer", "t", "--db-password", "--model", "m"]
    env = collect_environment(argv)
    assert env["argv"] == ["tandem", "bench", "serve", "--api-key", "***", "--hf-token=***", "--max-tokens", "16",
                           "--tokenizer", "t", "--db-password", "--model", "m"]
    assert env["env"]["TANDEM_KV_SECRET"] == "***" and env["env"]["TANDEM_GATEWAY_API_KEY"] == "***"
    assert env["env"]["TANDEM_MAX_TOKENS"] == "16"
    assert "s3cret" not in repr(env) and "hf_x" not in repr(env)
