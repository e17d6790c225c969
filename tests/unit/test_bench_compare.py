"""`tandem bench compare`: exit 1 on a planted regression, 0 otherwise, 2 on unusable input."""

from __future__ import annotations

import json

import pytest

from tandem.bench.cli import main
from tandem.bench.compare import higher_is_better, is_regression, parse_threshold

BASE = {
    "completed": 100, "failed": 0, "request_throughput": 10.0, "output_throughput": 1000.0,
    "total_token_throughput": 5000.0, "median_ttft_ms": 100.0, "p99_ttft_ms": 300.0,
    "median_tpot_ms": 20.0, "p99_tpot_ms": 40.0, "median_itl_ms": 19.0, "p99_itl_ms": 60.0,
    "median_e2el_ms": 2000.0, "p99_e2el_ms": 4000.0, "request_goodput": None,
}


def _write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def _compare(tmp_path, new, *extra, base=BASE):
    return main(["bench", "compare", _write(tmp_path, "base.json", base), _write(tmp_path, "new.json", new),
                 *extra])


def test_identical_runs_pass(tmp_path, capsys):
    assert _compare(tmp_path, dict(BASE)) == 0
    out = capsys.readouterr().out
    assert "| run | p99_ttft_ms | 300.00 | 300.00 | 1.000 | ok |" in out


def test_planted_latency_regression_fails(tmp_path, capsys):
    assert _compare(tmp_path, {**BASE, "p99_ttft_ms": 330.0}) == 1  # +10% > 5%
    assert "REGRESSION" in capsys.readouterr().out
    assert _compare(tmp_path, {**BASE, "p99_ttft_ms": 312.0}) == 0  # +4% is within 5%
    assert _compare(tmp_path, {**BASE, "p99_ttft_ms": 312.0}, "--max-regression", "3%") == 1


def test_planted_throughput_regression_fails(tmp_path):
    assert _compare(tmp_path, {**BASE, "output_throughput": 900.0}) == 1  # -10%
    assert _compare(tmp_path, {**BASE, "output_throughput": 1500.0}) == 0  # better is fine
    assert _compare(tmp_path, {**BASE, "median_tpot_ms": 10.0}) == 0  # faster is fine


def test_only_chosen_metrics_gate(tmp_path):
    new = {**BASE, "p99_e2el_ms": 8000.0}
    assert _compare(tmp_path, new, "--metrics", "output_throughput,median_ttft_ms") == 0
    assert _compare(tmp_path, new, "--metrics", "p99_e2el_ms") == 1
    assert _compare(tmp_path, {**BASE, "failed": 3}, "--metrics", "failed") == 1  # base 0: any rise


def test_sweep_results_compare_level_by_level(tmp_path):
    def sweep(scale):
        runs = [{**BASE, "max_concurrency": c, "output_throughput": 1000.0 * c * s}
                for c, s in zip((1, 2, 4), scale, strict=True)]
        return {"mode": "concurrency", "x_key": "max_concurrency", "levels": [1, 2, 4], "runs": runs}

    assert _compare(tmp_path, sweep((1, 1, 1)), base=sweep((1, 1, 1))) == 0
    assert _compare(tmp_path, sweep((1, 1, 0.8)), base=sweep((1, 1, 1))) == 1
    assert _compare(tmp_path, {**BASE}, base=sweep((1, 1, 1))) == 2  # levels differ


LATENCIES = [k for k in BASE if k.endswith("_ms")]
ALL_FAILED = {**BASE, "completed": 0, "failed": 100, "request_throughput": 0.0, "output_throughput": 0.0,
              "total_token_throughput": 0.0, **dict.fromkeys(LATENCIES)}


def test_run_where_everything_failed_is_a_regression(tmp_path, capsys):
    assert _compare(tmp_path, ALL_FAILED) == 1
    out = capsys.readouterr().out
    assert "| run | p99_ttft_ms | 300.00 | n/a | - | REGRESSION |" in out
    assert "| run | failed | 0.00 | 100.00 | - | REGRESSION |" in out
    assert "| run | success_rate | 1.00 | 0.00 | 0.000 | REGRESSION |" in out
    assert "p99_ttft_ms: 300.00 -> n/a" in out
    # Latencies alone: a null on the new side regresses, a null only on the base side does not.
    assert _compare(tmp_path, ALL_FAILED, "--metrics", "median_ttft_ms") == 1
    assert _compare(tmp_path, dict(BASE), "--metrics", "median_ttft_ms", base=ALL_FAILED) == 0
    assert _compare(tmp_path, ALL_FAILED, "--metrics", "median_ttft_ms", base=ALL_FAILED) == 1


def test_failures_are_compared_by_default(tmp_path):
    assert _compare(tmp_path, {**BASE, "completed": 97, "failed": 3}) == 1
    # A result without failed/success_rate (e.g. vLLM's) gets them from completed and num_prompts.
    vllm_like = {k: v for k, v in BASE.items() if k != "failed"} | {"num_prompts": 100}
    assert _compare(tmp_path, vllm_like, base=vllm_like) == 0
    assert _compare(tmp_path, {**vllm_like, "completed": 90}, "--metrics", "success_rate", base=vllm_like) == 1


def test_different_workloads_warn(tmp_path, capsys):
    workload = {"endpoint": "completions", "dataset": "random", "input_len": 1024, "output_len": 128,
                "num_prompts": 100}
    assert _compare(tmp_path, {**BASE, **workload}, base={**BASE, **workload}) == 0
    assert "warning" not in capsys.readouterr().err
    other = {**workload, "endpoint": "chat", "output_len": 64, "num_prompts": 50}
    assert _compare(tmp_path, {**BASE, **other}, base={**BASE, **workload}) == 0
    err = capsys.readouterr().err
    assert "warning: the runs used different workloads" in err
    assert "endpoint: 'completions' vs 'chat'" in err and "output_len: 128 vs 64" in err
    assert "num_prompts: 100 vs 50" in err and "input_len" not in err


def test_unusable_input_exits_2(tmp_path, capsys):
    assert _compare(tmp_path, dict(BASE), "--metrics", "request_goodput") == 2  # null in both: not measured
    assert _compare(tmp_path, {**BASE, "p99_ttft_ms": "fast"}) == 2
    assert _compare(tmp_path, dict(BASE), "--metrics", "mystery") == 2
    assert _compare(tmp_path, {"hello": 1}) == 2
    assert _compare(tmp_path, dict(BASE), "--max-regression=-5%") == 2
    assert "error" in capsys.readouterr().err


def test_threshold_and_direction_rules():
    assert parse_threshold("5%") == pytest.approx(0.05)
    assert parse_threshold("12.5") == pytest.approx(0.125)
    assert higher_is_better("output_throughput") and higher_is_better("request_goodput")
    assert not higher_is_better("p99_tpot_ms") and not higher_is_better("peak_server_rss_bytes")
    assert higher_is_better("success_rate") and not higher_is_better("failed")
    assert is_regression(100.0, 106.0, higher_better=False, threshold=0.05)
    assert not is_regression(100.0, 105.0, higher_better=False, threshold=0.05)
    assert is_regression(100.0, 94.0, higher_better=True, threshold=0.05)
