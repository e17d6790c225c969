"""`tandem bench` client against a scripted fake OpenAI server: timing, goodput, failures, arrivals.

Timing tolerance is the issue's 10 ms. The scripts use 50-120 ms delays so that loopback HTTP and
scheduling noise stay well inside it on an idle machine; the client and server share a small box.
"""

from __future__ import annotations

import functools
import math
import socket

import httpx
import pytest
from bench_fake_server import MODEL, FakeOpenAIServer

from tandem.bench.client import BenchConfig, arrival_offsets, fetch_model_id, run_benchmark
from tandem.bench.datasets import SampleRequest
from tandem.bench.metrics import calculate_metrics

TOL = 0.010  # seconds

# (ttft, itl, n) per request: distinct so that a mix-up between requests would show.
SCRIPTS = [(0.08, 0.05, 5), (0.05, 0.10, 3), (0.12, 0.06, 4), (0.06, 0.05, 1)]


def retry_on_noise(test):
    """Re-runs a timing test up to 3 times: a wrong metric fails every run, a descheduled thread on a
    busy 2-core box only one. NOTE: the 10 ms bound itself is never widened."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        for attempt in range(3):
            try:
                return test(*args, **kwargs)
            except AssertionError:
                if attempt == 2:
                    raise

    return wrapper


@pytest.fixture(scope="module")
def server():
    srv = FakeOpenAIServer().start()
    yield srv
    srv.stop()


def _requests(scripts, extra: str = "") -> list[SampleRequest]:
    return [SampleRequest(f"ttft={t} itl={i} n={n} {extra}", 3, n) for t, i, n in scripts]


def _config(server, **kw) -> BenchConfig:
    kw.setdefault("num_warmups", 2)
    return BenchConfig(base_url=server.base_url, model=MODEL, disable_tqdm=True, **kw)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@retry_on_noise
def test_timings_match_the_script(server, endpoint):
    """ITL and TPOT are differences of client timestamps and must match the script within 10 ms.
    TTFT and E2EL also hold the request's trip to the server (HTTP send, accept, parse), which
    is ~1-3 ms on an idle machine but reached 40 ms on this shared 2-core box under load; so they
    are compared with script + that measured trip (server receive time - client start, same
    clock), and must never beat the script."""
    # NOTE: for chat the fake server sends the role header at once; TTFT must still be the
    # first token's time, not the header's.
    tag = f"{endpoint}-"
    reqs = [SampleRequest(f"ttft={t} itl={i} n={n} id={tag}{k}", 3, n) for k, (t, i, n) in enumerate(SCRIPTS)]
    run = run_benchmark(_config(server, endpoint=endpoint, max_concurrency=2), reqs)
    metrics = calculate_metrics(run.results, run.duration_s, [50, 99])
    trips = []
    for k, ((ttft, itl, n), r) in enumerate(zip(SCRIPTS, run.results, strict=True)):
        assert r.success, r.error
        assert r.output_tokens == n
        trip = server.received[f"{tag}{k}"] - r.start_time
        trips.append(trip)
        assert trip >= 0
        assert r.ttft >= ttft
        assert r.ttft == pytest.approx(ttft + trip, abs=TOL)
        assert len(r.itl) == n - 1
        for gap in r.itl:
            assert gap == pytest.approx(itl, abs=TOL)
        assert r.latency >= ttft + (n - 1) * itl
        assert r.latency == pytest.approx(ttft + (n - 1) * itl + trip, abs=TOL)
        assert r.generated_text == "".join(f"t{k} " for k in range(n))
    # TPOT per request = (E2EL - TTFT) / (n - 1); the one-token request has no TPOT.
    tpots = sorted(itl for _, itl, n in SCRIPTS if n > 1)
    assert metrics["median_tpot_ms"] == pytest.approx(1000 * tpots[1], abs=1000 * TOL)
    assert metrics["mean_tpot_ms"] == pytest.approx(1000 * sum(tpots) / 3, abs=1000 * TOL)
    pooled = [itl for _, itl, n in SCRIPTS for _ in range(n - 1)]
    assert metrics["mean_itl_ms"] == pytest.approx(1000 * sum(pooled) / len(pooled), abs=1000 * TOL)
    e2els = [t + (n - 1) * i + trip for (t, i, n), trip in zip(SCRIPTS, trips, strict=True)]
    assert metrics["mean_e2el_ms"] == pytest.approx(1000 * sum(e2els) / 4, abs=1000 * TOL)
    assert metrics["completed"] == 4 and metrics["failed"] == 0
    assert metrics["total_output_tokens"] == 5 + 3 + 4 + 1
    assert metrics["total_input_tokens"] == 4 * 7  # the server's usage.prompt_tokens wins
    assert metrics["output_throughput"] == pytest.approx(13 / run.duration_s)


@retry_on_noise
def test_goodput_counts_exactly_the_requests_meeting_every_slo(server):
    scripts = [
        (0.05, 0.05, 4),  # meets ttft and tpot
        (0.20, 0.05, 4),  # ttft too slow
        (0.05, 0.13, 3),  # tpot too slow
        (0.05, 0.05, 1),  # one token: TPOT counts as 0 for the SLO (vLLM's rule)
        (0.06, 0.05, 3),  # meets both
    ]
    run = run_benchmark(_config(server), _requests(scripts))
    assert all(r.success for r in run.results)
    # NOTE: SLOs sit 60+ ms from every scripted value, so the request's trip to the server
    # (which only ever adds time) flips no verdict on an idle machine; on a loaded one a descheduled
    # thread added 100+ ms to every request once (CI-like run at load 5: 0 of 3 good), so the test
    # is retried (retry_on_noise): a wrong goodput rule fails every attempt.
    m = calculate_metrics(run.results, run.duration_s, [99], {"ttft": 150, "tpot": 90})
    assert m["good_completed"] == 3
    assert m["request_goodput"] == pytest.approx(3 / run.duration_s)
    # E2EL SLO alone: e2els are 0.20, 0.35, 0.31, 0.05, 0.16 s -> three at or under 280 ms.
    m = calculate_metrics(run.results, run.duration_s, [99], {"e2el": 280})
    assert m["good_completed"] == 3
    m = calculate_metrics(run.results, run.duration_s, [99])
    assert m["request_goodput"] is None and "good_completed" not in m


def test_failures_are_counted_by_kind_and_the_run_goes_on(server):
    prompts = [
        "ttft=0.05 itl=0.05 n=3",
        "mode=http500",
        "mode=drop n=5 drop_after=2",
        "mode=hang",
        "mode=badjson n=3",
        "mode=truncated n=3",
        "mode=nodone n=3",  # finish_reason without [DONE]: accepted
        "mode=nousage n=3",  # no usage chunk: output tokens fall back to chunk count
    ]
    reqs = [SampleRequest(p, None, 3) for p in prompts]
    run = run_benchmark(_config(server, timeout=0.6, num_warmups=0), reqs)
    kinds = [r.error_kind for r in run.results]
    assert kinds == [None, "http_500", "malformed_stream", "timeout", "malformed_stream",
                     "malformed_stream", None, None]
    assert "scripted failure" in run.results[1].error
    m = calculate_metrics(run.results, run.duration_s, [50])
    assert m["failures"] == {"http_500": 1, "malformed_stream": 3, "timeout": 1}
    assert m["completed"] == 3 and m["failed"] == 5
    assert m["total_output_tokens"] == 9
    assert m["error_kinds"] == kinds


def test_connection_refused_is_a_connection_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = BenchConfig(base_url=f"http://127.0.0.1:{port}", model="m", disable_tqdm=True, timeout=5)
    run = run_benchmark(config, [SampleRequest("x", None, 2)] * 3)
    assert [r.error_kind for r in run.results] == ["connection_error"] * 3
    with pytest.raises(httpx.HTTPError):
        fetch_model_id(f"http://127.0.0.1:{port}")


def test_model_id_comes_from_v1_models(server):
    assert fetch_model_id(server.base_url + "/v1/") == MODEL


def test_max_concurrency_caps_requests_in_flight():
    srv = FakeOpenAIServer().start()
    try:
        reqs = _requests([(0.05, 0.05, 2)] * 6)
        run = run_benchmark(_config(srv, max_concurrency=2, num_warmups=0), reqs)
        assert all(r.success for r in run.results)
        assert httpx.get(srv.base_url + "/stats").json()["peak_in_flight"] == 2
    finally:
        srv.stop()


@retry_on_noise
def test_request_rate_spaces_the_sends(server):
    # burstiness inf = constant gaps of 1 / rate: sends at 0, 50, 100, 150 ms after the start.
    config = _config(server, request_rate=20.0, burstiness=math.inf, num_warmups=1)
    run = run_benchmark(config, _requests([(0.05, 0.05, 2)] * 4))
    starts = [r.start_time for r in run.results]
    for a, b in zip(starts, starts[1:], strict=False):
        assert b - a == pytest.approx(0.05, abs=TOL)


def test_arrival_offsets_follow_vllm():
    assert arrival_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    assert arrival_offsets(4, 2.0, math.inf, 0) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    a = arrival_offsets(1000, 10.0, 1.0, seed=7)
    assert a == arrival_offsets(1000, 10.0, 1.0, seed=7)
    assert a[-1] == pytest.approx(100.0)  # rescaled: n / rate
    assert all(x <= y for x, y in zip(a, a[1:], strict=False))
    gaps = [y - x for x, y in zip([0.0, *a], a, strict=False)]
    # Poisson: exponential gaps, coefficient of variation 1; burstiness 4 is smoother (CV 0.5).
    cv = lambda g: float(__import__("numpy").std(g) / __import__("numpy").mean(g))  # noqa: E731
    assert cv(gaps) == pytest.approx(1.0, abs=0.1)
    b = arrival_offsets(1000, 10.0, 4.0, seed=7)
    assert cv([y - x for x, y in zip([0.0, *b], b, strict=False)]) == pytest.approx(0.5, abs=0.07)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError):
        BenchConfig(base_url="http://x", model="m", endpoint="embeddings")
    with pytest.raises(ValueError):
        BenchConfig(base_url="http://x", model="m", request_rate=0)
    with pytest.raises(ValueError):
        BenchConfig(base_url="http://x", model="m", max_concurrency=0)
    assert BenchConfig(base_url="http://h:1/v1/", model="m", endpoint="chat").api_url == (
        "http://h:1/v1/chat/completions"
    )
