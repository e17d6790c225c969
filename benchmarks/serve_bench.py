"""Decode speed through the server, side by side: ``tandem serve`` vs llama.cpp's OpenAI server, same GGUF.

Issue 11's "default model on AVX2 through ``tandem serve``" goal is a serving figure, so this measures
what a client sees: each server in turn is started on the same file with the same thread count, warmed
up, then ``tandem bench serve`` sends ``--num-prompts`` random prompts of ``--input-len`` tokens, one at a
time (``--concurrency 1``; more levels with several values), streaming, greedy, ``--output-len`` tokens
(``ignore_eos``; llama.cpp's server has no such field, so its requests may end earlier: compare TPOT).
Reported per server and level: the median time per output token after the first (TPOT) as tokens/s,
the output throughput, TTFT p50, and the mean output length. The servers alternate for ``--repeats``
rounds (the machine is shared; the median over rounds is printed), each in its own process group,
killed before the next one starts.

llama.cpp is ``llama-cpp-python`` 0.3.36's ``python -m llama_cpp.server`` from the benchmark venv
(``benchmarks/peers.py``, built for this CPU), ``--n_threads`` = ``--threads``.

    PYTHONPATH=$PWD python benchmarks/serve_bench.py --repeats 2 --json /tmp/serve.json
    PYTHONPATH=$PWD python benchmarks/serve_bench.py --concurrency 1 4 --output-len 64
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
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402

from tandem.models.resolve import default_model_gguf  # noqa: E402

SERVED = "bench"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(name: str, args: argparse.Namespace, port: int) -> list[str]:
    if name == "tandem":
        return [sys.executable, "-m", "tandem.cli", "serve", "--model", str(args.model), "--port", str(port),
                "--served-model-name", SERVED, "--num-threads", str(args.threads), *args.tandem_arg]
    python = peers.ensure_venv("llama.cpp")
    return [str(python), "-m", "llama_cpp.server", "--model", str(args.model), "--model_alias", SERVED,
            "--port", str(port), "--host", "127.0.0.1", "--n_threads", str(args.threads),
            "--n_threads_batch", str(args.threads), "--n_ctx", "2048"]


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"server not ready within {timeout_s} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench_level(url: str, args: argparse.Namespace, concurrency: int, out: Path) -> dict:
    """One ``tandem bench serve`` run against ``url``; its saved metrics."""
    cmd = [sys.executable, "-m", "tandem.cli", "bench", "serve", "--base-url", url, "--model", SERVED,
           "--tokenizer", str(args.model), "--input-len", str(args.input_len), "--output-len",
           str(args.output_len), "--num-prompts", str(args.num_prompts * concurrency), "--max-concurrency",
           str(concurrency), "--ignore-eos", "--temperature", "0", "--num-warmups", "1", "--disable-tqdm",
           "--seed", "0", "--save-result", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    return {"tpot_tok_s": 1000.0 / result["median_tpot_ms"], "output_tok_s": result["output_throughput"],
            "ttft_p50_ms": result["median_ttft_ms"],
            "mean_output_tokens": result["total_output_tokens"] / result["completed"]}


def run_server(name: str, args: argparse.Namespace, work: Path) -> dict[int, dict]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(work / f"{name}.log", "a")
    proc = subprocess.Popen(server_command(name, args, port), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        _wait_ready(url, proc, 600)
        return {c: bench_level(url, args, c, work / f"{name}-{c}.json") for c in args.concurrency}
    finally:
        _stop(proc)
        log.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the default model's)")
    p.add_argument("--servers", nargs="+", default=["tandem", "llama.cpp"], choices=["tandem", "llama.cpp"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1])
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=6, help="requests per level = this x concurrency")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tandem-arg", action="append", default=[], help="extra `tandem serve` flag (repeatable)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    args.model = args.model or default_model_gguf()
    rounds: dict[str, list[dict[int, dict]]] = {name: [] for name in args.servers}
    loads = [peers.load_average()]
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        for _ in range(args.repeats):
            for name in args.servers:
                rounds[name].append(run_server(name, args, Path(tmp)))
                loads.append(peers.load_average())
    print(f"{args.model.name}, {args.threads} threads, {args.input_len}-token prompts, {args.output_len} "
          f"tokens, median of {args.repeats} rounds, load average {min(loads):.1f}-{max(loads):.1f}")
    summary: dict[str, dict] = {}
    for name, runs in rounds.items():
        for c in args.concurrency:
            med = {k: statistics.median(run[c][k] for run in runs) for k in runs[0][c]}
            summary.setdefault(name, {})[c] = med
            print(f"  {name:9s} concurrency {c:2d}: {med['tpot_tok_s']:6.1f} tok/s per stream (TPOT), "
                  f"{med['output_tok_s']:6.1f} tok/s output, TTFT p50 {med['ttft_p50_ms']:.0f} ms, "
                  f"{med['mean_output_tokens']:.0f} tokens/request")
    if {"tandem", "llama.cpp"} <= summary.keys():
        for c in args.concurrency:
            print(f"  ratio Tandem / llama.cpp at concurrency {c}: "
                  f"{summary['tandem'][c]['tpot_tok_s'] / summary['llama.cpp'][c]['tpot_tok_s']:.2f}x per stream")
    if args.json:
        args.json.write_text(json.dumps({"rounds": rounds, "median": summary, "load": loads,
                                         "model": str(args.model), "threads": args.threads}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
