"""`tandem bench` speculative-decoding figures: scraped from the fake server's real Prometheus
counters (which advance by `SPEC_PER_REQUEST` per request, warm-ups included) before and after
the timed run; absent, unparseable or unauthorized /metrics gives `spec_decode: null`."""

from __future__ import annotations

import json

import pytest
from bench_fake_server import MODEL, SPEC_PER_REQUEST, FakeOpenAIServer

from tandem.bench.cli import main
from tandem.bench.client import BenchConfig, run_benchmark
from tandem.bench.datasets import SampleRequest
from tandem.bench.spec_metrics import SpecCounters, parse_spec_counters, spec_decode_delta
from tandem.bench.sweep import run_sweep

N = 5  # timed requests per run


def _expected(num_requests: int) -> dict:
    """3 drafts, 12 draft tokens, 7 accepted (3/2/1/1 by position) per request."""
    assert SPEC_PER_REQUEST == {"drafts": 3, "draft_tokens": 12, "accepted": 7, "per_pos": (3, 2, 1, 1)}
    n = num_requests
    return {
        "num_drafts": 3 * n, "num_draft_tokens": 12 * n, "num_accepted_tokens": 7 * n,
        "accepted_tokens_per_position": [3 * n, 2 * n, n, n],
        "acceptance_rate": pytest.approx(7 / 12),
        "mean_acceptance_length": pytest.approx(1 + 7 / 3),
        "acceptance_rate_per_position": pytest.approx([1.0, 2 / 3, 1 / 3, 1 / 3]),
    }


def _run(server: FakeOpenAIServer, **kw):
    config = BenchConfig(base_url=server.base_url, model=MODEL, disable_tqdm=True, **kw)
    reqs = [SampleRequest("ttft=0.01 itl=0.005 n=3", 3, 3)] * N
    return run_benchmark(config, reqs)


@pytest.mark.parametrize("prefix", ["tandem", "vllm"])
def test_run_reports_the_counter_increase_of_the_timed_requests(prefix):
    server = FakeOpenAIServer(metrics_prefix=prefix).start()
    try:
        # NOTE: the 2 warm-ups advance the counters too; the before-scrape must follow them.
        run = _run(server, num_warmups=2, max_concurrency=2)
        assert all(r.success for r in run.results)
        assert run.spec_decode == _expected(N)
        run = _run(server)  # counters keep growing: each run reports its own increase only
        assert run.spec_decode == _expected(N)
    finally:
        server.stop()


def test_api_key_is_sent_to_metrics():
    server = FakeOpenAIServer(metrics_prefix="tandem", api_key="sekrit").start()
    try:
        assert _run(server, api_key="sekrit").spec_decode == _expected(N)
        run = _run(server)  # 401 on /metrics: no figures, but the run itself succeeds
        assert run.spec_decode is None and all(r.success for r in run.results)
    finally:
        server.stop()


@pytest.mark.parametrize("metrics_prefix", [None, "garbage"])
def test_missing_or_unparseable_metrics_give_null_and_a_successful_run(metrics_prefix, tmp_path, capsys):
    server = FakeOpenAIServer(metrics_prefix=metrics_prefix).start()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ttft=0.01 itl=0.005 n=2"}\n')
    path = tmp_path / "run.json"
    try:
        assert main(["bench", "serve", "--base-url", server.base_url, "--model", MODEL, "--dataset", "jsonl",
                     "--dataset-path", str(prompts), "--num-prompts", "3", "--disable-tqdm",
                     "--save-result", str(path)]) == 0
    finally:
        server.stop()
    saved = json.loads(path.read_text())
    assert saved["completed"] == 3 and saved["spec_decode"] is None
    assert "Speculative Decoding" not in capsys.readouterr().out


def test_serve_cli_prints_and_saves_the_figures(tmp_path, capsys):
    server = FakeOpenAIServer(metrics_prefix="vllm").start()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ttft=0.01 itl=0.005 n=2"}\n')
    path = tmp_path / "run.json"
    try:
        assert main(["bench", "serve", "--base-url", server.base_url, "--model", MODEL, "--dataset", "jsonl",
                     "--dataset-path", str(prompts), "--num-prompts", "4", "--num-warmups", "1",
                     "--disable-tqdm", "--save-result", str(path)]) == 0
    finally:
        server.stop()
    assert json.loads(path.read_text())["spec_decode"] == _expected(4)
    lines = {line.rsplit(None, 1)[0]: line.split()[-1] for line in capsys.readouterr().out.splitlines()
             if line.strip() and not line.startswith(("=", "-"))}
    assert lines["Acceptance rate (%):"] == "58.33" and lines["Acceptance length:"] == "3.33"
    assert (lines["Drafts:"], lines["Draft tokens:"], lines["Accepted tokens:"]) == ("12", "48", "28")
    assert [lines[f"  Position {i}:"] for i in range(4)] == ["100.00", "66.67", "33.33", "33.33"]


def test_sweep_table_has_acceptance_columns_per_level(tmp_path):
    server = FakeOpenAIServer(metrics_prefix="tandem").start()
    config = BenchConfig(base_url=server.base_url, model=MODEL, disable_tqdm=True)
    reqs = [SampleRequest("ttft=0.01 itl=0.005 n=2", 3, 2)]
    try:
        report = run_sweep(config, reqs, mode="concurrency", levels=[1, 2], output_dir=str(tmp_path),
                           percentiles=[], num_prompts=3, verbose=False)
    finally:
        server.stop()
    assert [run["spec_decode"] for run in report["runs"]] == [_expected(3)] * 2
    rows = [line for line in (tmp_path / "results.md").read_text().splitlines() if line.startswith("| ")]
    assert rows[0].endswith("| peak RSS MiB | accept % | accept len | accept % by pos |")
    for row in rows[1:]:
        assert [c.strip() for c in row.split("|")[-4:-1]] == ["58.33", "3.33", "100/67/33/33"]


def test_sweep_table_has_no_acceptance_columns_without_figures(tmp_path):
    server = FakeOpenAIServer().start()
    config = BenchConfig(base_url=server.base_url, model=MODEL, disable_tqdm=True)
    try:
        run_sweep(config, [SampleRequest("n=2", 3, 2)], mode="concurrency", levels=[1],
                  output_dir=str(tmp_path), percentiles=[], num_prompts=1, verbose=False)
    finally:
        server.stop()
    header = (tmp_path / "results.md").read_text().splitlines()[4]
    assert header.endswith("| peak RSS MiB |") and "accept" not in header


def test_parse_sums_labels_and_needs_the_scalar_counters():
    page = (
        "# TYPE vllm:spec_decode_num_drafts counter\n"
        'vllm:spec_decode_num_drafts_total{engine="0"} 4\nvllm:spec_decode_num_drafts_total{engine="1"} 6\n'
        "# TYPE vllm:spec_decode_num_draft_tokens counter\nvllm:spec_decode_num_draft_tokens_total 30\n"
        "# TYPE vllm:spec_decode_num_accepted_tokens counter\nvllm:spec_decode_num_accepted_tokens_total 12\n"
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter\n"
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="2"} 1\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",position="2"} 2\n'
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3\n"
    )
    assert parse_spec_counters(page) == SpecCounters(10, 30, 12, {2: 3})
    assert parse_spec_counters("# TYPE tandem:generation_tokens counter\ntandem:generation_tokens_total 9\n") is None
    with pytest.raises(ValueError):
        parse_spec_counters('{"detail": "Not Found"}')


def test_delta_edge_cases():
    before = SpecCounters(10, 40, 20, {0: 8})
    gap = spec_decode_delta(before, SpecCounters(12, 48, 23, {0: 10, 2: 1}))
    assert gap["accepted_tokens_per_position"] == [2, 0, 1]  # position 1 never reported: 0
    assert gap["acceptance_rate_per_position"] == [1.0, 0.0, 0.5]
    assert gap["acceptance_rate"] == 3 / 8 and gap["mean_acceptance_length"] == 2.5
    idle = spec_decode_delta(before, before)  # e.g. a Tandem server without speculation
    assert idle["num_drafts"] == 0 and idle["acceptance_rate"] is None
    assert idle["mean_acceptance_length"] is None and idle["acceptance_rate_per_position"] == []
    assert spec_decode_delta(before, SpecCounters(1, 4, 2, {})) is None  # restarted in between
    assert spec_decode_delta(None, before) is None and spec_decode_delta(before, None) is None
