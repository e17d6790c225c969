"""Batch-1 decode when another process keeps one core busy: OpenMP wait policies and thread counts.

Usage:
    python benchmarks/contention_bench.py [--shape qwen2.5-0.5b] [--work-dir DIR] [--tokens 24]

For each of "no other load" and "one busy process" (a Python spin loop started by this script),
runs greedy batch-1 decode of a random-weight checkpoint in a fresh process for each configuration:
2 threads with libgomp's default wait policy, 2 threads with ``OMP_WAIT_POLICY=passive``, 1 thread.
Each worker prints wall-clock tokens/s over ``--tokens`` new tokens after a warm-up generation.
A fresh process per configuration because libgomp reads ``OMP_WAIT_POLICY`` when it starts.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CONFIGS = (("2 threads, default wait policy", 2, {}), ("2 threads, OMP_WAIT_POLICY=passive", 2,
           {"OMP_WAIT_POLICY": "passive"}), ("1 thread", 1, {}))


def worker(model_dir: str, threads: int, tokens: int) -> None:
    """Runs in the child: prints ``tokens/s`` of one batch-1 greedy generation."""
    from tandem import LLM, SamplingParams

    llm = LLM(model_dir, num_threads=threads)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate([[1, 2, 3, 4]], params)  # warm-up: kernels loaded, caches touched
    t0 = time.perf_counter()
    llm.generate([[5, 6, 7, 8]], params)
    print(f"{tokens / (time.perf_counter() - t0):.1f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--work-dir", help="keep and reuse the checkpoint here (default: a temporary folder)")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--worker", nargs=2, metavar=("MODEL_DIR", "THREADS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.tokens)
        return
    from checkpoints import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp)
        model_dir = make_checkpoint(args.shape, work / args.shape / "hf")
        print(f"| {args.shape}, batch-1 decode tokens/s | no other load | one busy process |\n|---|---|---|")
        results: dict[str, list[str]] = {name: [] for name, _, _ in CONFIGS}
        for busy in (False, True):
            spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            try:
                for name, threads, env in CONFIGS:
                    out = subprocess.run(
                        [sys.executable, __file__, "--worker", str(model_dir), str(threads), "--tokens",
                         str(args.tokens)],
                        env={**os.environ, **env}, capture_output=True, text=True, check=True,
                    )
                    results[name].append(out.stdout.strip().splitlines()[-1])
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
        for name, values in results.items():
            print(f"| {name} | {' | '.join(values)} |")


if __name__ == "__main__":
    main()
