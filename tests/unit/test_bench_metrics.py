"""`tandem bench` metric arithmetic on hand-made request results (no server, no timing)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tandem.bench.client import RequestResult
from tandem.bench.metrics import (
    calculate_metrics,
    output_token_count,
    parse_goodput,
    parse_percentiles,
    percentile_key,
)
from tandem.bench.report import cdf_points, format_summary


def _ok(ttft, itl, out_tokens, prompt_len=10, text=""):
    return RequestResult(success=True, prompt_len=prompt_len, output_tokens=out_tokens, ttft=ttft,
                         itl=list(itl), latency=ttft + sum(itl), generated_text=text)


def test_vllm_definitions():
    results = [
        _ok(0.100, [0.02, 0.04, 0.03], 4),  # TPOT (0.19 - 0.10) / 3 = 0.03
        _ok(0.300, [0.05], 2, prompt_len=20),  # TPOT 0.05
        _ok(0.200, [], 1),  # one token: no TPOT, E2EL = TTFT
        RequestResult(prompt_len=99).fail("http_503", "busy"),
        RequestResult(prompt_len=99).fail("timeout", "slow"),
    ]
    m = calculate_metrics(results, duration_s=2.0, percentiles=[50, 90, 99.9])
    assert m["completed"] == 3 and m["failed"] == 2 and m["success_rate"] == pytest.approx(0.6)
    assert m["failures"] == {"http_503": 1, "timeout": 1}
    assert m["total_input_tokens"] == 40  # failed requests' prompts are not counted
    assert m["total_output_tokens"] == 7
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx(23.5)
    ttfts = np.array([100.0, 300.0, 200.0])
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["std_ttft_ms"] == pytest.approx(float(np.std(ttfts)))
    assert m["p90_ttft_ms"] == pytest.approx(280.0)  # linear interpolation
    assert m["p99.9_ttft_ms"] == pytest.approx(float(np.percentile(ttfts, 99.9)))
    assert m["mean_tpot_ms"] == pytest.approx(40.0)  # mean of 30 and 50
    itls = [20.0, 40.0, 30.0, 50.0]  # pooled over requests
    assert m["mean_itl_ms"] == pytest.approx(np.mean(itls))
    assert m["median_itl_ms"] == pytest.approx(35.0)
    assert m["mean_e2el_ms"] == pytest.approx((190.0 + 350.0 + 200.0) / 3)
    assert m["request_goodput"] is None
    assert m["output_lens"] == [4, 2, 1, 0, 0]
    assert m["ttfts"] == [0.1, 0.3, 0.2, None, None]  # failures have no latency, not 0
    assert m["error_kinds"] == [None, None, None, "http_503", "timeout"]


def test_goodput_slos_apply_together():
    results = [
        _ok(0.100, [0.03, 0.03], 3),  # ttft 100, tpot 30, e2el 160
        _ok(0.250, [0.03, 0.03], 3),  # ttft too slow for 200
        _ok(0.100, [0.08, 0.08], 3),  # tpot 80 too slow for 50
        _ok(0.150, [], 1),  # tpot counts as 0
    ]
    assert calculate_metrics(results, 1.0, [99], {"ttft": 200})["good_completed"] == 3
    assert calculate_metrics(results, 1.0, [99], {"tpot": 50})["good_completed"] == 3
    assert calculate_metrics(results, 1.0, [99], {"ttft": 200, "tpot": 50})["good_completed"] == 2
    m = calculate_metrics(results, 2.0, [99], {"ttft": 200, "tpot": 50, "e2el": 155})
    assert m["good_completed"] == 1  # only the one-token request (e2el 150)
    assert m["request_goodput"] == pytest.approx(0.5)
    # SLO boundaries are inclusive, as in vLLM (slo >= value).
    assert calculate_metrics(results, 1.0, [99], {"ttft": 100})["good_completed"] == 2


def test_output_tokens_fall_back_to_tokenizer_then_chunks():
    class WordTokenizer:
        def __call__(self, text, add_special_tokens=True):
            ids = list(range(len(text.split())))
            return type("Enc", (), {"input_ids": ([0] if add_special_tokens else []) + ids})

    r = _ok(0.1, [0.01, 0.01], None, text="three little words plus two")
    assert output_token_count(r, WordTokenizer()) == 5
    assert output_token_count(r, None) == 3  # one per streamed chunk
    r.output_tokens = 9
    assert output_token_count(r, WordTokenizer()) == 9


def test_all_failed_reports_nulls_not_zeros():
    m = calculate_metrics([RequestResult().fail("connection_error", "refused")] * 2, 1.0, [99])
    assert (m["completed"], m["failed"], m["success_rate"], m["request_throughput"]) == (0, 2, 0.0, 0.0)
    latency_keys = [k for k in m if k.endswith("_ms")]
    assert len(latency_keys) == 4 * 4  # mean, median, std, p99 of ttft, tpot, itl, e2el
    assert all(m[k] is None for k in latency_keys)
    assert m["ttfts"] == m["e2els"] == [None, None]
    assert json.loads(json.dumps(m))["p99_e2el_ms"] is None  # saved as JSON null
    summary = format_summary({**m, "peak_server_rss_bytes": None}, [99])
    latency_lines = [line for line in summary.splitlines() if "(ms):" in line]
    assert len(latency_lines) == 12 and all(line.split()[-1] == "n/a" for line in latency_lines)
    assert "0.00" not in "\n".join(latency_lines)
    with pytest.raises(ValueError):
        calculate_metrics([], 0.0, [99])


def test_single_token_requests_have_no_tpot_or_itl():
    m = calculate_metrics([_ok(0.2, [], 1), _ok(0.4, [], 1)], 1.0, [50])
    assert m["mean_ttft_ms"] == pytest.approx(300.0) and m["p50_e2el_ms"] == pytest.approx(300.0)
    assert m["mean_tpot_ms"] is None and m["p50_itl_ms"] is None and m["success_rate"] == 1.0


def test_parsers():
    assert parse_goodput("ttft:500,tpot:50") == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput("e2el:1e3") == {"e2el": 1000.0}
    assert parse_goodput(None) == {}
    for bad in ("itl:5", "ttft=5", "ttft:-1", "ttft:abc"):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    assert parse_percentiles("50,90,99.9") == [50.0, 90.0, 99.9]
    with pytest.raises(ValueError):
        parse_percentiles("101")
    assert percentile_key(99.0) == "p99" and percentile_key(99.9) == "p99.9"


def test_latency_cdf_starts_at_zero():
    xs, ys = cdf_points([30.0, 10.0, 20.0])
    assert xs == [0.0, 10.0, 20.0, 30.0]
    assert ys == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0])
