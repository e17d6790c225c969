"""`tandem gateway` live on loopback: two real `tandem serve` processes (stories260K; the candidate
with another context limit and model name) and a scripted faulty backend, driven by the official
`openai` client through the gateway."""

from __future__ import annotations

import dataclasses
import json
import random
import time

import httpx
import openai
import pytest
from faulty_backend import FaultyBackend, ThreadServer
from live_server import Server, metric_samples

from tandem.gateway.app import build_gateway_app
from tandem.gateway.canary import sticky_point
from tandem.gateway.config import BackendConfig, CanaryConfig, FallbackConfig, GateConfig, GatewayConfig, ShadowConfig
from tandem.gateway.proxy import Gateway

GW_KEY, PRIMARY_KEY, CANDIDATE_KEY, FAULTY_KEY = "gw-client-key", "primary-key", "candidate-key", "faulty-key"


@pytest.fixture(scope="module")
def servers(stories_dir, tmp_path_factory):
    """Primary: stories260K as `stories`; candidate: the same weights as `stories-next`, max-model-len 256."""
    logs = tmp_path_factory.mktemp("gateway")
    primary = Server(stories_dir, logs / "primary.log", "--api-key", PRIMARY_KEY, "--served-model-name", "stories")
    candidate = Server(stories_dir, logs / "candidate.log", "--api-key", CANDIDATE_KEY, "--served-model-name",
                       "stories-next", "--max-model-len", "256")
    try:
        # NOTE: on a loaded 2-core machine the front ends take minutes to import; the default 120 s is short
        primary.wait_healthy(600)
        candidate.wait_healthy(600)
        yield primary, candidate
    finally:
        primary.stop()
        candidate.stop()


@pytest.fixture
def faulty():
    backend = FaultyBackend()
    with ThreadServer(backend.app) as server:
        backend.url = server.url
        yield backend


def _config(primary_url: str, candidate: BackendConfig, **changes) -> GatewayConfig:
    base = GatewayConfig(primary=BackendConfig("primary", primary_url, PRIMARY_KEY), candidate=candidate,
                         api_key=GW_KEY, gates=GateConfig(enabled=False))
    return dataclasses.replace(base, **changes)


def _real_candidate(servers) -> BackendConfig:
    return BackendConfig("candidate", servers[1].url, CANDIDATE_KEY, {"stories": "stories-next"})


def _faulty_candidate(faulty) -> BackendConfig:
    return BackendConfig("candidate", faulty.url, FAULTY_KEY, {"stories": "faulty"})


class Running:
    """A gateway in a uvicorn thread plus an openai client pointed at it."""

    def __init__(self, config: GatewayConfig, rng_seed: int = 0) -> None:
        self.gateway = Gateway(config, rng=random.Random(rng_seed))
        self.server = ThreadServer(build_gateway_app(config, self.gateway))

    def __enter__(self) -> Running:
        self.server.__enter__()
        self.url = self.server.url
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=GW_KEY, max_retries=0, timeout=30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        self.server.__exit__(*exc)

    def complete(self, **kw):
        raw = self.client.completions.with_raw_response.create(model="stories", prompt=kw.pop("prompt", "Once"),
                                                                max_tokens=kw.pop("max_tokens", 2), temperature=0, **kw)
        return raw.headers["x-tandem-backend"], raw.parse()

    def status(self) -> dict:
        return httpx.get(f"{self.url}/gateway/status", headers={"Authorization": f"Bearer {GW_KEY}"}, timeout=5).json()


def test_weights_stickiness_keys_and_usage(servers):
    config = _config(servers[0].url, _real_candidate(servers), canary=CanaryConfig(weight=0.5))
    with Running(config, rng_seed=1) as gw:
        n = 100
        served = [gw.complete(max_tokens=1) for _ in range(n)]
        to_candidate = sum(backend == "candidate" for backend, _ in served)
        # NOTE: Binomial(100, 0.5) has sd 5; 3.5 sd either side fails a correct split once in ~2000 runs
        assert 33 <= to_candidate <= 67, to_candidate
        # the candidate got its own model name and key (the real server would answer 404 / 401 otherwise),
        # and its answers name the model the client asked for
        assert {r.model for _, r in served} == {"stories"} and 0 < to_candidate
        by_user = [gw.complete(max_tokens=1, user="alice") for _ in range(15)]
        by_header = [gw.complete(max_tokens=1, extra_headers={"x-session-id": "s-42"}) for _ in range(15)]
        assert len({b for b, _ in by_user}) == 1 and len({b for b, _ in by_header}) == 1
        stream = gw.client.completions.create(model="stories", prompt="Once", max_tokens=3, temperature=0,
                                              stream=True, stream_options={"include_usage": True})
        stream_usage = [c.usage for c in stream if c.usage][0]
        seen = [r.usage for _, r in served + by_user + by_header] + [stream_usage]
        # a stream without include_usage is counted too (the gateway asked for usage), the client sees none
        chunks = list(gw.client.completions.create(model="stories", prompt="Once", max_tokens=3, temperature=0,
                                                   stream=True, user="alice"))
        assert all(c.usage is None and c.choices for c in chunks) and {c.model for c in chunks} == {"stories"}
        seen.append(stream_usage)  # NOTE: the same prompt, greedy, 3 tokens (finish "length"): the same usage
        assert chunks[-1].choices[0].finish_reason == "length" and stream_usage.completion_tokens == 3
        totals = gw.status()["totals"]
        assert totals["requests"] == n + 32
        assert totals["completion_tokens"] == sum(u.completion_tokens for u in seen)
        assert totals["prompt_tokens"] == sum(u.prompt_tokens for u in seen)
        bad = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=PRIMARY_KEY, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.completions.create(model="stories", prompt="x", max_tokens=1)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"


def _sse_bytes(url: str, key: str, body: dict) -> bytes:
    """A stream's raw bytes with each chunk's id and created time blanked (they differ per request)."""
    import re

    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=30) as r:
        raw = r.read()
    assert r.status_code == 200, raw
    return re.sub(rb'"created":\d+', b'"created":0', re.sub(rb'"id":"[^"]*"', b'"id":""', raw))


def test_stream_without_usage_is_as_the_backend_sends_it_and_is_counted(servers):
    """The gateway asks the candidate for usage; the client still gets the candidate's own stream
    (Tandem adds `"usage": null` to every chunk then: removed too) under its own model name."""
    config = _config(servers[0].url, _real_candidate(servers), canary=CanaryConfig(weight=1.0))
    body = {"prompt": "Once upon", "max_tokens": 4, "temperature": 0, "stream": True, "logprobs": 1}
    direct = _sse_bytes(servers[1].url, CANDIDATE_KEY, {**body, "model": "stories-next"})
    with Running(config) as gw:
        through = _sse_bytes(gw.url, GW_KEY, {**body, "model": "stories"})
        assert direct.count(b'"model":"stories-next"') >= 4 and b'"usage"' not in direct
        assert through == direct.replace(b'"model":"stories-next"', b'"model":"stories"')
        assert b'"usage"' not in through and b"stories-next" not in through and through.count(b"data: ") >= 5
        assert gw.status()["totals"]["completion_tokens"] == 4 and gw.status()["totals"]["prompt_tokens"] > 0


def test_keys_never_cross_and_shadow_not_billed(servers, faulty):
    config = _config(servers[0].url, _faulty_candidate(faulty), shadow=ShadowConfig(fraction=1.0))
    with Running(config) as gw:
        backend, answer = gw.complete(max_tokens=2)
        assert backend == "primary"
        deadline = time.monotonic() + 10
        while gw.status()["shadow"]["compared"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        leg = faulty.requests[-1]
        assert leg["shadow"] and leg["headers"]["authorization"] == f"Bearer {FAULTY_KEY}"
        assert GW_KEY not in json.dumps(leg["headers"]) and PRIMARY_KEY not in json.dumps(leg["headers"])
        assert leg["body"]["model"] == "faulty"
        status = gw.status()
        # the shadow's usage (5 tokens) is not in the totals: only the client's own request
        assert status["totals"]["completion_tokens"] == answer.usage.completion_tokens
        assert status["shadow"]["diverged"] == 1 and "text" in status["shadow"]["recent_divergences"][0]["tiers"]
        assert "sample" not in status["shadow"]["recent_divergences"][0]


def test_shadow_never_delays_primary(servers, faulty):
    faulty.mode = "stall_shadow"
    config = _config(servers[0].url, _faulty_candidate(faulty), shadow=ShadowConfig(fraction=1.0, max_concurrency=1))
    with Running(config) as gw:
        assert gw.complete()[0] == "primary"
        # the primary answered while its shadow leg is still held by the candidate
        assert gw.status()["shadow"]["in_flight"] == 1 and faulty.requests[-1]["shadow"]
        assert gw.complete()[0] == "primary"  # beyond the bound: dropped, not queued
        assert gw.status()["shadow"]["dropped"] == 1
        faulty.release_shadows()
        deadline = time.monotonic() + 10
        while gw.status()["shadow"]["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gw.status()["shadow"]["compared"] == 1


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_and_half_open_probe_closes(servers, faulty):
    faulty.mode = "error"
    config = _config(servers[0].url, _faulty_candidate(faulty), canary=CanaryConfig(weight=1.0),
                     fallback=FallbackConfig(breaker_failures=3, breaker_cooldown_s=30))
    clock = Clock()
    gw_state = Gateway(config, clock=clock)
    with ThreadServer(build_gateway_app(config, gw_state)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=GW_KEY, max_retries=0)
        for _ in range(3):  # each falls back to the primary
            raw = client.completions.with_raw_response.create(model="stories", prompt="x", max_tokens=1)
            assert raw.headers["x-tandem-backend"] == "primary"
        assert gw_state.breakers["candidate"].state == "open" and len(faulty.requests) == 3
        client.completions.create(model="stories", prompt="x", max_tokens=1)
        assert len(faulty.requests) == 3  # open: the candidate is not tried
        faulty.mode = "ok"
        clock.now += 31
        raw = client.completions.with_raw_response.create(model="stories", prompt="x", max_tokens=1)
        assert raw.headers["x-tandem-backend"] == "candidate"  # the half-open probe
        assert gw_state.breakers["candidate"].state == "closed"
        m = metric_samples(server.url)
        assert m[("tandem_gateway_breaker_opened_total", (("backend", "candidate"),))] == 1
        assert m[("tandem_gateway_fallbacks_total", (("from_backend", "candidate"), ("to_backend", "primary")))] == 4
        kinds = [e["message"] for e in gw_state.status()["events"] if e["kind"] == "breaker"]
        assert kinds == ["candidate: closed -> open", "candidate: open -> half_open"] or \
            kinds[-1] == "candidate: half_open -> closed"


def test_no_first_byte_in_time_falls_back_within_the_retry_budget(servers, faulty):
    faulty.mode = "stall"
    config = _config(servers[0].url, _faulty_candidate(faulty), canary=CanaryConfig(weight=1.0),
                     fallback=FallbackConfig(first_byte_timeout_s=0.3, retry_ratio=0.0, min_retries=1))
    with Running(config) as gw:
        assert gw.complete()[0] == "primary"  # the stalled candidate timed out before its first byte
        with pytest.raises(openai.APIStatusError) as e:  # the budget (1 retry) is spent: no second fallback
            gw.complete()
        assert e.value.status_code == 504 and e.value.body["code"] == "timeout"
        assert e.value.body["message"] == ("no backend answered (candidate: no first byte within 0.3 s; "
                                           "primary: not tried, the retry budget is spent)")
        m = metric_samples(gw.url)
        assert m[("tandem_gateway_attempt_failures_total", (("backend", "candidate"), ("reason", "timeout")))] == 2
        assert m[("tandem_gateway_retry_budget_exhausted_total", ())] == 1
        faulty.release_shadows()


@pytest.mark.parametrize("fault", ["error", "slow"])
def test_planted_regression_rolls_back(servers, faulty, fault):
    faulty.mode, faulty.delay_s = ("error", 0.0) if fault == "error" else ("ok", 0.25)
    gates = GateConfig(min_requests=4, max_error_rate=0.2, max_latency_ratio=2.0, min_latency_samples=4)
    config = _config(servers[0].url, _faulty_candidate(faulty), canary=CanaryConfig(weight=0.5), gates=gates,
                     fallback=FallbackConfig(breaker_failures=100))
    with Running(config) as gw:
        # sticky keys that the split sends to each side (sticky_point < weight: the candidate)
        keys = [f"u{i}" for i in range(200)]
        to_primary = [k for k in keys if sticky_point(k) >= 0.5][:4]
        to_candidate = [k for k in keys if sticky_point(k) < 0.5]
        for key in to_primary:  # the primary's latency samples first
            list(gw.client.completions.create(model="stories", prompt="x", max_tokens=4, stream=True, user=key))
        for key in to_candidate[:8]:
            if gw.status()["canary"]["rolled_back"]:
                break
            list(gw.client.completions.create(model="stories", prompt="x", max_tokens=4, stream=True, user=key))
        status = gw.status()
        assert status["canary"]["rolled_back"] and status["canary"]["weights"]["candidate"] == 0
        reason = status["canary"]["rollback_reason"]
        assert ("error rate" in reason) if fault == "error" else ("p95 TTFT" in reason or "p95 TPOT" in reason)
        assert [e["kind"] for e in status["events"]].count("rollback") == 1
        m = metric_samples(gw.url)
        assert m[("tandem_gateway_rolled_back", ())] == 1 and m[("tandem_gateway_canary_weight", ())] == 0
        assert {gw.complete(user=f"after{i}")[0] for i in range(10)} == {"primary"}


def test_midstream_failure_ends_with_error_event_and_done(servers, faulty):
    faulty.mode = "midstream"
    config = _config(servers[0].url, _faulty_candidate(faulty), canary=CanaryConfig(weight=1.0))
    with Running(config) as gw:
        body = {"model": "stories", "prompt": "x", "max_tokens": 3, "stream": True}
        with httpx.stream("POST", f"{gw.url}/v1/completions", json=body, timeout=10,
                          headers={"Authorization": f"Bearer {GW_KEY}"}) as r:
            data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200 and r.headers["x-tandem-backend"] == "candidate"
        assert [json.loads(d)["choices"][0]["text"] for d in data[:2]] == ["Once", " upon"]
        error = json.loads(data[2])["error"]
        assert error["code"] == "backend_stream_broken" and data[3] == "[DONE]"
        assert error["message"] == "candidate: the backend stream broke after its first byte (RemoteProtocolError)"
        assert len(data) == 4
        with pytest.raises(openai.APIError, match="stream broke"):
            list(gw.client.completions.create(model="stories", prompt="x", max_tokens=3, stream=True))
        m = metric_samples(gw.url)
        assert m[("tandem_gateway_midstream_failures_total", (("backend", "candidate"),))] == 2


def _chromium() -> str:
    import shutil

    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it with apt-get where apt works)")
    return path


def test_status_page_renders_weights_in_headless_chromium(faulty, tmp_path):
    import subprocess

    chromium = _chromium()
    config = _config(faulty.url, _faulty_candidate(faulty), canary=CanaryConfig(weight=0.25))
    with Running(config) as gw:
        gw.complete()
        cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=1500",
               "--dump-dom", f"http://admin:{GW_KEY}@127.0.0.1:{gw.server.port}/gateway/"]
        dom = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    assert '<b id="weight-primary">75.0%</b>' in dom and '<b id="weight-candidate">25.0%</b>' in dom
    # the live refresh ran in the browser and redrew one row per backend
    assert "refreshed live at 20" in dom and "rendered by the server" not in dom
    assert dom.count("<tr><td>primary</td><td>closed</td>") == 1 and dom.count("<tr><td>candidate</td>") == 1


def test_drill_measures_fallback_when_the_candidate_is_killed(servers, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from live_server import free_port

    from tandem.cli import main
    from tandem.gateway.drill import DrillConfig, run_drill

    port = free_port()
    script = Path(__file__).with_name("faulty_backend.py")
    candidate = subprocess.Popen([sys.executable, str(script), str(port), "0.1"])
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{url}/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and candidate.poll() is None
                time.sleep(0.1)
        config = _config(servers[0].url, BackendConfig("candidate", url, FAULTY_KEY, {"stories": "faulty"}),
                         canary=CanaryConfig(weight=1.0), fallback=FallbackConfig(breaker_failures=2))
        with Running(config) as gw:
            assert main(["drill", "--gateway", gw.url, "--candidate-stop", "true", "--dry-run"]) == 0
            report = run_drill(DrillConfig(gateway=gw.url, stop_command=f"kill -9 {candidate.pid}", model="stories",
                                           api_key=GW_KEY, rate=10, warmup_s=1.0, observe_s=1.5, max_tokens=2))
    finally:
        candidate.kill()
        candidate.wait()
    assert report["stop_exit_code"] == 0 and report["candidate_down_after_s"] is not None
    # NOTE: requests still waiting for their first byte at the kill fell back to the primary
    assert report["before_stop"]["served_by"]["candidate"] >= 1
    assert report["recovered"] and 0 <= report["fallback_time_s"] < 1.5
    assert report["after_stop"]["lost"] == 0 and report["after_stop"]["served_by"] == {
        "primary": report["after_stop"]["requests"]}
    flight = report["in_flight_at_stop"]
    # a killed backend's streams end with the gateway's error event; none is left hanging
    assert flight["count"] >= 1 and flight["completed"] + flight["ended_with_error_event"] == flight["count"]
    assert report["requests_lost"] == report["before_stop"]["lost"] == flight["ended_with_error_event"]
    # a stream lost at the kill is a lost client request: the drill fails and says how many
    lost = report["requests_lost"]
    assert report["passed"] == (lost == 0) and (f"FAILED: {lost} client request(s) lost" in report["verdict"]
                                                if lost else report["verdict"].startswith("PASSED"))
    cont = report["continuity"]
    assert cont["scrape_failures"] == 0 and cont["requests_counter_monotonic"] and cont["event_log_gaps"] == []
    assert "candidate: closed -> open" in [e["message"] for e in cont["events"]]


def test_compare_builtin_set_between_two_tandem_servers(servers, tmp_path):
    from tandem.cli import main

    out = tmp_path / "report"
    code = main(["compare", "--a", servers[0].url, "--api-key-a", PRIMARY_KEY, "--b", servers[1].url,
                 "--api-key-b", CANDIDATE_KEY, "--output-dir", str(out)])
    report = json.loads((out / "compare.json").read_text())
    assert (report["a"]["model"], report["b"]["model"]) == ("stories", "stories-next")
    assert report["max_model_len"] == {"a": 512, "b": 256}
    cases = {c["name"]: c for c in report["cases"]}
    assert {"stop_string", "streaming_split", "tool_call", "json_schema", "long_input_near_limit", "empty_prompt",
            "unicode", "n2_seeded", "logprobs", "fail_input_over_limit"} <= set(cases)
    for c in report["cases"]:
        if c["expect_status"] is not None:
            assert c["a"]["status"] == c["b"]["status"] == c["expect_status"], c["name"]
    assert cases["long_input_near_limit"]["b"]["status"] == 200  # sized for the smaller limit (256)
    assert cases["logprobs"]["a"]["status"] == 200 and len(cases["n2_seeded"]["a"]["texts"]) == 2
    # same weights, greedy or seeded: no difference, no noise, every check passed
    assert report["summary"]["diverged_rate"] == 0 and report["summary"]["noise_rate"] == 0
    assert report["summary"]["failed_checks"] == 0
    # stories260K has no chat template: the chat cases ran on neither side, so no clean pass (exit 1)
    not_run = [c for c in report["cases"] if c["not_run"]]
    assert all(c["not_run"].startswith("A: HTTP 400: ") for c in not_run), [c["not_run"] for c in not_run]
    assert any("no chat template" in c["not_run"] for c in not_run)
    assert report["summary"]["cases_not_run"] == len(not_run) and code == 1
    assert "<table>" in (out / "compare.html").read_text() and "| stop_string | 200 | 200 |" in (
        out / "compare.md").read_text()
    assert PRIMARY_KEY not in (out / "compare.json").read_text()


def test_compare_reports_a_planted_difference(servers, faulty, tmp_path):
    from tandem.cli import main

    prompts = tmp_path / "cases.jsonl"
    prompts.write_text('{"name": "story", "prompt": "Once upon a time", "max_tokens": 3}\n')
    code = main(["compare", "--a", servers[0].url, "--api-key-a", PRIMARY_KEY, "--b", faulty.url,
                 "--prompts", str(prompts), "--output-dir", str(tmp_path / "r")])
    report = json.loads((tmp_path / "r" / "compare.json").read_text())
    # the scripted backend's text and prompt token count are not stories260K's
    assert code == 1 and [d["tier"] for d in report["cases"][0]["diffs_beyond_noise"]] == ["text", "usage"]
    assert report["summary"]["tiers"]["text"] == {"divergence_rate": 1.0, "noise_rate": 0.0, "beyond_noise_rate": 1.0}
