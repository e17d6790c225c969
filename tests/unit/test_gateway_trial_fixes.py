"""Regressions from the fresh-user trial of the migration toolkit (issue 14), without a model."""

from __future__ import annotations

import asyncio
import functools
import json

import httpx
import pytest

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


def test_non_streamed_answers_have_no_ttft_and_latency_gates_need_samples():
    from tandem.gateway.canary import CanaryController, Outcome
    from tandem.gateway.capture import capture_body
    from tandem.gateway.config import CanaryConfig, GateConfig

    assert capture_body(200, b'{"choices": []}', 0.0).ttft_s is None
    c = CanaryController(CanaryConfig(weight=0.3), GateConfig(), True, lambda: 0.0)
    # The trial's case: 10 candidate answers, p95 about 2 x the primary's: too few samples to judge.
    for i in range(10):
        c.record(Outcome(0, "primary", True, 0.040, 0.01))
        c.record(Outcome(0, "candidate", True, 0.088 if i == 9 else 0.040, 0.01))
    assert not c.rolled_back and c.weight == 0.3
    for _ in range(30):  # enough samples on both sides, and really 3 x slower: rolls back
        c.record(Outcome(0, "primary", True, 0.040, 0.01))
        c.record(Outcome(0, "candidate", True, 0.120, 0.01))
    assert c.rolled_back and c.rollback_reason.startswith("candidate p95 TTFT 120.0 ms > 2 x primary 40.0 ms")


def test_gate_flags_override_the_yaml_file(tmp_path):
    from tandem.cli import build_parser
    from tandem.gateway.cli import gateway_config_from_args

    path = tmp_path / "gateway.yaml"
    path.write_text("primary: 'http://a:1'\ncandidate: 'http://b:2'\ngates: {window_s: 30, min_requests: 5}\n")
    args = build_parser().parse_args(["gateway", "--config", str(path), "--gate-min-latency-samples", "50",
                                      "--gate-max-latency-ratio", "3", "--no-gates"])
    g = gateway_config_from_args(args).gates
    got = (g.window_s, g.min_requests, g.min_latency_samples, g.max_latency_ratio, g.enabled)
    assert got == (30, 5, 50, 3.0, False)


def test_steps_promote_with_the_gates_disabled():
    from tandem.gateway.canary import CanaryController, Outcome
    from tandem.gateway.config import CanaryConfig, CanaryStep, GateConfig

    now = [0.0]
    steps = (CanaryStep(0.1, 3), CanaryStep(0.5, 3), CanaryStep(1.0, 0))
    c = CanaryController(CanaryConfig(steps=steps), GateConfig(enabled=False, min_requests=1), True, lambda: now[0])
    seen = []
    for t in (1.0, 3.0, 4.0, 6.0, 9.0):
        now[0] = t
        c.record(Outcome(t, "candidate", False))  # errors only: a disabled gate never rolls back
        seen.append(c.weight)
    assert seen == [0.1, 0.5, 0.5, 1.0, 1.0] and c.promotions == 2 and not c.rolled_back


@pytest.mark.parametrize(("text", "message"), [
    ("primary: [unclosed\n", "not valid YAML: while parsing"),
    ("primary: 'http://a'\ncandidate: 'http://b'\ncanary: {weight: high}\n",
     "canary.weight: expected a number, got 'high'"),
    ("primary: {url: 5}\n", "primary.url: expected a string, got 5"),
    ("primary: 'http://a'\ncandidate: {url: 'http://b', extra: 1}\n", "candidate: unknown keys ['extra']"),
    ("primary: 'http://a'\nfallback: {breaker_failures: 2.5}\n",
     "fallback.breaker_failures: expected an integer, got 2.5"),
    ("primary: 'http://a'\nport: abc\n", "port: expected an integer, got 'abc'"),
    ("primary: {url: 'http://a', model_map: [a]}\n", "primary.model_map: expected a mapping of client model name"),
    ("primary: 'http://a'\ngates: {enabled: 'no'}\n", "gates.enabled: expected true or false, got 'no'"),
    ("primary: 'http://a'\ncandidate: 'http://b'\ncanary: {steps: [{weight: 1, hold_s: x}]}\n",
     "canary.steps[0].hold_s: expected a number, got 'x'"),
])
def test_config_file_errors_name_the_setting(tmp_path, capsys, text, message):
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    assert main(["gateway", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_config_directory_and_bad_step_flag_are_one_line_errors(tmp_path, capsys):
    assert main(["gateway", "--config", str(tmp_path)]) == 2
    assert f"--config {tmp_path}: cannot read it (Is a directory)" in capsys.readouterr().err
    assert main(["gateway", "--primary", "http://a", "--candidate", "http://b", "--canary-steps", "0.1:abc"]) == 2
    assert "--canary-steps item '0.1:abc': could not convert string to float: 'abc'" in capsys.readouterr().err


def test_prompts_file_is_validated_and_endpoint_stays_out_of_the_body(tmp_path):
    from tandem.gateway.regression import load_cases

    path = tmp_path / "p.jsonl"
    path.write_text('{"name": "c", "endpoint": "chat/completions", "messages": [{"role": "user", "content": "hi"}]}\n')
    (case,) = load_cases(str(path))
    assert case.endpoint == "chat/completions" and "endpoint" not in case.body and "name" not in case.body
    for line, message in (('{"body": "str"}', "body must be a JSON object, got str"),
                          ('{"prompt": "x", "endpoint": "embeddings"}', "endpoint must be completions or chat")):
        path.write_text(line + "\n")
        with pytest.raises(ValueError, match=message):
            load_cases(str(path))


def test_compare_reports_cases_that_failed_on_both_sides_as_not_run(monkeypatch):
    from tandem.gateway.compare_run import Side, run_cases
    from tandem.gateway.regression import Case
    from tandem.gateway.reports import compare_markdown

    def server(request: httpx.Request) -> httpx.Response:
        body = {"error": {"message": "the model has no chat template", "type": "invalid_request_error",
                          "param": None, "code": None}}
        return httpx.Response(400, headers={"content-type": "application/json"},
                              stream=httpx.ByteStream(json.dumps(body).encode()))

    transport = httpx.MockTransport(server)
    monkeypatch.setattr(httpx, "AsyncClient", functools.partial(httpx.AsyncClient, transport=transport))
    case = Case("chat", "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    report = asyncio.run(run_cases(Side("a", "http://a", None, "m"), Side("b", "http://b", None, "m"), [case], 5.0))
    row = report["cases"][0]
    reason = "HTTP 400: the model has no chat template"
    assert row["not_run"] == f"A: {reason}; B: {reason}"
    assert row["a"]["error"] == "HTTP 400: the model has no chat template" and report["summary"]["cases_not_run"] == 1
    assert "not run on either side (A: HTTP 400" in compare_markdown(report)
