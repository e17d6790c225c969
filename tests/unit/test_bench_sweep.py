"""`tandem bench sweep` and `serve` end to end against the scripted fake server: files written,
their content, the CLI wiring, and server memory sampling."""

from __future__ import annotations

import json
import mmap
import os

import pytest
from bench_fake_server import MODEL, FakeOpenAIServer

from tandem.bench.cli import main
from tandem.bench.client import BenchConfig
from tandem.bench.datasets import SampleRequest
from tandem.bench.memory import MemorySampler
from tandem.bench.sweep import run_sweep

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PNGS = ("throughput.png", "ttft.png", "tpot.png", "latency_cdf.png")


@pytest.fixture(scope="module")
def server():
    srv = FakeOpenAIServer().start()
    yield srv
    srv.stop()


def test_sweep_writes_json_markdown_and_pngs(server, tmp_path):
    config = BenchConfig(base_url=server.base_url, model=MODEL, disable_tqdm=True)
    reqs = [SampleRequest("ttft=0.02 itl=0.01 n=3", 5, 3), SampleRequest("mode=http500", 5, 3)]
    out = tmp_path / "report"
    report = run_sweep(config, reqs, mode="concurrency", levels=[1, 2], output_dir=str(out),
                       percentiles=[90], num_prompts=4, verbose=False)
    data = json.loads((out / "results.json").read_text())
    assert data == json.loads(json.dumps(report))
    assert [run["max_concurrency"] for run in data["runs"]] == [1, 2]
    for run in data["runs"]:
        assert run["completed"] == 2 and run["failures"] == {"http_500": 2}
        assert run["request_rate"] == "inf" and run["num_prompts"] == 4
        assert run["total_output_tokens"] == 6
        assert {"p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms"} <= set(run)  # 50 and 99 always added
    md = (out / "results.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| max_concurrency | ok | failed |")
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["1", "2"]
    assert [r.split("|")[2:4] for r in rows[1:]] == [[" 2 ", " 2 "]] * 2
    for name in PNGS:
        blob = (out / name).read_bytes()
        assert blob.startswith(PNG_MAGIC) and len(blob) > 2000, name


def test_sweep_cli_rate_ladder_with_jsonl_and_memory(server, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ttft=0.02 itl=0.01 n=2", "output_len": 2}\n')
    out = tmp_path / "rates"
    code = main(["bench", "sweep", "--base-url", server.base_url, "--dataset", "jsonl",
                 "--dataset-path", str(prompts), "--request-rates", "20,40", "--num-prompts", "3",
                 "--output-dir", str(out), "--server-pid", str(os.getpid()), "--disable-tqdm"])
    assert code == 0
    data = json.loads((out / "results.json").read_text())
    assert data["x_key"] == "request_rate" and [r["request_rate"] for r in data["runs"]] == [20.0, 40.0]
    assert all(r["model_id"] == MODEL for r in data["runs"])  # taken from /v1/models
    assert all(r["peak_server_rss_bytes"] > 10 * 2**20 for r in data["runs"])
    assert all((out / name).is_file() for name in ("results.md", *PNGS))


def test_serve_cli_saves_result_and_exit_codes(server, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ttft=0.02 itl=0.01 n=3"}\n{"prompt": "mode=http500"}\n')
    result_path = tmp_path / "run.json"
    args = ["bench", "serve", "--base-url", server.base_url, "--model", MODEL, "--endpoint", "chat",
            "--dataset", "jsonl", "--dataset-path", str(prompts), "--num-prompts", "4",
            "--goodput", "ttft:1000", "--percentiles", "50,99", "--disable-tqdm"]
    assert main([*args, "--save-result", str(result_path)]) == 0
    saved = json.loads(result_path.read_text())
    assert saved["completed"] == 2 and saved["failures"] == {"http_500": 2}
    assert saved["good_completed"] == 2 and saved["endpoint"] == "chat"
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "P99 TTFT (ms):" in out and "http_500:" in out
    prompts.write_text('{"prompt": "mode=http500"}\n')
    capsys.readouterr()
    assert main([*args, "--save-result", str(result_path)]) == 1  # nothing succeeded
    latency_lines = [line for line in capsys.readouterr().out.splitlines() if "(ms):" in line]
    assert latency_lines and all(line.split()[-1] == "n/a" for line in latency_lines)
    saved = json.loads(result_path.read_text())
    assert saved["p99_ttft_ms"] is None and saved["success_rate"] == 0.0
    assert (saved["dataset"], saved["output_len"], saved["input_len"]) == ("jsonl", 128, None)
    assert main([*args, "--goodput", "itl:5"]) == 2  # bad flag value


def _missing_pid() -> int:
    import psutil

    pid = 999999
    while psutil.pid_exists(pid):
        pid += 1
    return pid


def test_serve_cli_rejects_bad_lengths_and_pid_up_front(tmp_path, capsys):
    """No server is needed: the flags are checked before /v1/models is asked."""
    args = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", MODEL, "--tokenizer", "x",
            "--disable-tqdm"]
    for extra, message in [(["--output-len", "0"], "--output-len must be >= 1, got 0"),
                           (["--input-len", "0"], "--input-len must be >= 1, got 0"),
                           (["--server-pid", str(_missing_pid())], "no such process")]:
        assert main([*args, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, extra
    assert main(["bench", "sweep", *args[2:], "--num-prompts", "0", "--output-dir", str(tmp_path)]) == 2
    assert "--num-prompts must be >= 1, got 0" in capsys.readouterr().err


def test_serve_cli_takes_the_tokenizer_from_the_model_root(server, stories_dir, tmp_path, capsys):
    args = ["bench", "serve", "--base-url", server.base_url, "--input-len", "12", "--output-len", "3",
            "--num-prompts", "2", "--disable-tqdm", "--save-result", str(tmp_path / "r.json")]
    server.model_root = str(tmp_path / "not-here")  # a root that is no local path: no tokenizer
    try:
        assert main(args) == 2
        assert "needs a tokenizer" in capsys.readouterr().err
        server.model_root = str(stories_dir)
        assert main(args) == 0
    finally:
        server.model_root = None
    assert f"tokenizer: {stories_dir}" in capsys.readouterr().out
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["completed"] == 2 and saved["model_id"] == MODEL
    assert (saved["dataset"], saved["input_len"], saved["output_len"]) == ("random", 12, 3)


def test_memory_sampler_sums_the_process_tree():
    sampler = MemorySampler(os.getpid(), interval_s=0.01)
    sampler.start()
    # NOTE: a fresh anonymous mapping, so the pages are new to the process whatever the allocator
    # kept from earlier tests (a bytearray may reuse already-resident heap pages).
    blob = mmap.mmap(-1, 64 * 2**20)
    for offset in range(0, len(blob), 4096):
        blob[offset] = 1
    sampler.stop()
    assert sampler.first_bytes is not None
    assert sampler.peak_bytes >= sampler.first_bytes + 50 * 2**20
    blob.close()


def test_memory_counts_child_processes():
    import subprocess
    import sys
    import time

    import psutil

    from tandem.bench.memory import tree_rss_bytes

    me = psutil.Process(os.getpid())
    before = tree_rss_bytes(me)
    code = "b = bytearray(80 * 2**20); b[::4096] = b'\\x01' * len(b[::4096]); import time; time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 20
        while tree_rss_bytes(me) < before + 80 * 2**20 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tree_rss_bytes(me) >= before + 80 * 2**20
    finally:
        child.kill()
        child.wait()
