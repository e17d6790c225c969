"""Serving throughput with and without thread pinning, interleaved in one run window.

For each repeat and each ``--cpu-bind`` value (order alternating between repeats) this starts
``tandem serve --cpu-bind VALUE``, runs ``tandem bench serve`` against it, stops the server (its whole
process group, also on errors) and records output tokens/s, TPOT and TTFT from the saved result.

    PYTHONPATH=$PWD python benchmarks/cpu_bind_bench.py --repeats 2 --binds auto none
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from startup_bench import DEFAULT_MODEL, REPO, answered, load_average, stop, tandem_env

SERVED_NAME = "bench"


def run_one(args: argparse.Namespace, bind: str, tag: str) -> dict:
    port = args.port
    log = args.log_dir / f"serve-{tag}.log"
    cmd = [sys.executable, "-m", "tandem.cli", "--log-level", "INFO", "serve", "--model", str(args.model),
           "--served-model-name", SERVED_NAME, "--port", str(port), "--kv-cache-gib", "1",
           "--max-model-len", "2048", "--cpu-bind", bind]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=tandem_env(None), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=tempfile.gettempdir())
        try:
            deadline = time.monotonic() + args.timeout
            while not answered(port):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server did not start; see {log}")
                time.sleep(0.2)
            result = args.log_dir / f"bench-{tag}.json"
            bench = [sys.executable, "-m", "tandem.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                     "--served-model-name", SERVED_NAME, "--tokenizer", str(args.model), "--input-len",
                     str(args.input_len), "--output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
                     "--max-concurrency", str(args.max_concurrency), "--ignore-eos", "--disable-tqdm",
                     "--num-warmups", "1", "--save-result", str(result)]
            subprocess.run(bench, env=tandem_env(None), check=True, capture_output=True, cwd=REPO)
            data = json.loads(result.read_text())
        finally:
            stop(proc)
    return data


def pick(data: dict, *names: str) -> float:
    for name in names:
        if name in data:
            return float(data[name])
    raise KeyError(f"none of {names} in the result (keys: {sorted(data)})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--binds", nargs="+", default=["auto", "none"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--port", type=int, default=8941)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "tandem-cpu-bind-bench")
    args = p.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[float]] = {b: [] for b in args.binds}
    print(f"model {args.model}; load average before: {load_average()}", flush=True)
    for i in range(args.repeats):
        order = args.binds if i % 2 == 0 else list(reversed(args.binds))
        for bind in order:
            data = run_one(args, bind, f"{bind.replace(',', '_')}-{i}")
            tps = pick(data, "output_throughput", "output_tokens_per_s")
            rows[bind].append(tps)
            print(f"run {i} --cpu-bind {bind:6s}: {tps:6.1f} output tok/s, median TPOT "
                  f"{pick(data, 'median_tpot_ms'):.1f} ms, median TTFT {pick(data, 'median_ttft_ms'):.0f} ms; "
                  f"load {load_average()}", flush=True)
    for bind, values in rows.items():
        print(f"--cpu-bind {bind}: median {statistics.median(values):.1f} output tok/s over {len(values)} run(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
