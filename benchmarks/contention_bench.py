"""Batch-1 decode when other processes keep the cores busy: OpenMP wait policies and thread counts.

Usage:
    python benchmarks/contention_bench.py [--shape qwen2.5-0.5b | --model default|PATH] [--work-dir DIR]
        [--tokens 24] [--busy N]

For each of "no other load" and "N busy processes" (Python spin loops started by this script; default
one per allowed core), runs greedy batch-1 decode of a random-weight checkpoint (or ``--model``: a
folder, a .gguf, or ``default`` for the default model) in a fresh process for each configuration of
``CONFIGS``: libgomp's default wait policy (spin 300000 iterations before sleeping), short spins
(``GOMP_SPINCOUNT``), ``OMP_WAIT_POLICY=passive``, 1 thread. ``TANDEM_OMP_WAIT=keep`` stops Tandem from
setting its own default (``tandem/worker/cpu_env.py``), so each row measures what it names. Each worker
prints wall-clock tokens/s over ``--tokens`` new tokens after a warm-up generation; the last column is
loaded / quiet. A fresh process per configuration because libgomp reads its variables when it starts.
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

KEEP = {"TANDEM_OMP_WAIT": "keep"}
CONFIGS = (
    ("2 threads, libgomp default (spin 300000)", 2, KEEP),
    ("2 threads, GOMP_SPINCOUNT=10000", 2, {**KEEP, "GOMP_SPINCOUNT": "10000"}),
    ("2 threads, GOMP_SPINCOUNT=1000", 2, {**KEEP, "GOMP_SPINCOUNT": "1000"}),
    ("2 threads, OMP_WAIT_POLICY=passive", 2, {**KEEP, "OMP_WAIT_POLICY": "passive"}),
    ("2 threads, Tandem's default", 2, {}),
    ("1 thread", 1, KEEP),
)


def worker(model_dir: str, threads: int, tokens: int) -> None:
    """Runs in the child: prints ``tokens/s`` of one batch-1 greedy generation."""
    from tandem import LLM, SamplingParams

    llm = LLM(None if model_dir == "default" else model_dir, num_threads=threads, progress=False)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate([[1, 2, 3, 4]], params)  # warm-up: kernels loaded, caches touched
    t0 = time.perf_counter()
    llm.generate([[5, 6, 7, 8]], params)
    print(f"{tokens / (time.perf_counter() - t0):.1f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--work-dir", help="keep and reuse the checkpoint here (default: a temporary folder)")
    p.add_argument("--model", help="decode this model instead of a random --shape checkpoint ('default': SmolLM2)")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--busy", type=int, default=len(os.sched_getaffinity(0)), help="busy processes under load")
    p.add_argument("--only", nargs="*", type=int, help="indices of CONFIGS to run (default: all)")
    p.add_argument("--worker", nargs=2, metavar=("MODEL_DIR", "THREADS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.tokens)
        return
    from checkpoints import make_checkpoint

    configs = [c for i, c in enumerate(CONFIGS) if args.only is None or i in args.only]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp)
        model_dir = args.model or make_checkpoint(args.shape, work / args.shape / "hf")
        label = args.model or args.shape
        print(f"| {label}, batch-1 decode tokens/s | no other load | {args.busy} busy process(es) | ratio |\n"
              "|---|---|---|---|")
        results: dict[str, list[str]] = {name: [] for name, _, _ in configs}
        for busy in (False, True):
            spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                        for _ in range(args.busy if busy else 0)]
            try:
                for name, threads, env in configs:
                    out = subprocess.run(
                        [sys.executable, __file__, "--worker", str(model_dir), str(threads), "--tokens",
                         str(args.tokens)],
                        env={**os.environ, **env}, capture_output=True, text=True, check=True,
                    )
                    results[name].append(out.stdout.strip().splitlines()[-1])
            finally:
                for spinner in spinners:
                    spinner.kill()
                    spinner.wait()
        for name, (quiet, loaded) in results.items():
            print(f"| {name} | {quiet} | {loaded} | {float(loaded) / float(quiet):.2f} |")


if __name__ == "__main__":
    main()
