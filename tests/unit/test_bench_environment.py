"""Recorded benchmark environments and `tandem bench compare`'s warning when they differ."""

from __future__ import annotations

import hashlib
import json
import os

from tandem.bench.client import RequestResult
from tandem.bench.compare import run_compare
from tandem.bench.environment import collect_environment, environment_differences, model_file_hashes
from tandem.bench.metrics import calculate_metrics


def test_collect_environment_records_the_machine_and_the_model_files(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 10)
    (tmp_path / "notes.md").write_text("not a model file")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("TANDEM_KERNEL_BACKEND", "torch")
    env = collect_environment(["tandem", "bench", "serve", "--max-concurrency", "4"], [str(tmp_path), "hub/name"])
    assert env["argv"] == ["tandem", "bench", "serve", "--max-concurrency", "4"]
    assert env["env"]["OMP_NUM_THREADS"] == "2" and env["env"]["TANDEM_KERNEL_BACKEND"] == "torch"
    assert env["model_files"] == {"config.json": hashlib.sha256(b'{"a": 1}').hexdigest(),
                                  "model.safetensors": hashlib.sha256(b"\x00" * 10).hexdigest()}
    assert env["cpu_count"] == os.cpu_count() and env["memory_bytes"] > 2**30
    assert env["kernel_backend"].startswith("client: ")  # no server URL given
    assert any(p.lower().startswith("httpx==") for p in env["pip_freeze"])
    assert len(env["git_commit"] or "0" * 40) == 40 and env["tandem_version"]
    assert "avx2" in env["cpu_flags"] or not env["cpu_flags"]


def test_environment_differences_lists_what_changed():
    base = {"tandem_version": "0.1.0", "cpu_model": "EPYC", "cpu_flags": ["avx2", "fma"], "env": {},
            "pip_freeze": ["torch==2.13.0", "httpx==0.28.1"], "model_files": {"m.gguf": "aa"}}
    new = {**base, "cpu_model": "Xeon", "cpu_flags": ["avx2", "avx512f", "fma"],
           "pip_freeze": ["torch==2.13.0", "httpx==0.27.0", "numpy==2.0"], "model_files": {"m.gguf": "bb"}}
    assert environment_differences(base, new) == [
        "cpu_model: 'EPYC' vs 'Xeon'", "model_files: {'m.gguf': 'aa'} vs {'m.gguf': 'bb'}",
        "cpu_flags: only base [], only new ['avx512f']", "packages (2): httpx 0.28.1 -> 0.27.0, numpy None -> 2.0"]
    assert environment_differences(base, base) == [] and environment_differences(None, new) == []


def test_timeouts_and_ooms_are_counted_per_run():
    results = [RequestResult(success=True, ttft=0.1, latency=0.2, output_tokens=2, prompt_len=3),
               RequestResult().fail("timeout", "slow"), RequestResult().fail("http_500", "CUDA out of memory")]
    m = calculate_metrics(results, 1.0, [99])
    assert (m["timeouts"], m["ooms"], m["success_rate"]) == (1, 1, 1 / 3)


def _result(path, environment, throughput=10.0):
    data = {"completed": 4, "failed": 0, "num_prompts": 4, "request_throughput": throughput,
            "environment": environment}
    path.write_text(json.dumps(data))
    return str(path)


def test_bench_compare_warns_when_environments_differ(tmp_path, capsys):
    env = {"tandem_version": "0.1.0", "git_commit": "a" * 40, "kernel_backend": "avx2", "pip_freeze": []}
    base = _result(tmp_path / "base.json", env)
    same = _result(tmp_path / "same.json", env)
    other = _result(tmp_path / "other.json", {**env, "git_commit": "b" * 40, "kernel_backend": "torch"})
    assert run_compare(base, same, ["request_throughput"], 0.05) == 0
    assert "different environments" not in capsys.readouterr().err
    assert run_compare(base, other, ["request_throughput"], 0.05) == 0  # a warning, not a failure
    err = capsys.readouterr().err
    assert "measured in different environments" in err and "kernel_backend: 'avx2' vs 'torch'" in err
    assert f"git_commit: '{'a' * 40}' vs '{'b' * 40}'" in err


def test_model_file_hashes_of_a_single_file(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert model_file_hashes([str(f), None]) == {"m.gguf": hashlib.sha256(b"GGUF").hexdigest()}
