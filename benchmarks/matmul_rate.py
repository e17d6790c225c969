"""This CPU's measured fp32 matmul rate: GFLOP/s of ``torch.mm`` at prefill-like shapes.

Usage:
    python benchmarks/matmul_rate.py [--threads 2] [--repeats 10] [--json out.json]

The reference for issue 11's "prefill uses fp32 GEMM at >= 70% of this CPU's measured fp32 matmul
rate": M = 512 tokens times the Qwen2.5-0.5B linears (K x N: qkv 896 x 1152, o 896 x 896, gate/up
896 x 4864, fused gate_up 896 x 9728, down 4864 x 896). Each shape is timed in two layouts:
``nn`` = ``torch.mm(x [M, K], w [K, N])`` and ``nt`` = ``torch.mm(x, w [N, K].t())`` (a checkpoint's
weight layout, what ``F.linear`` does); per shape the median of ``--repeats`` timed calls after two
warm-up calls, 2 * M * K * N flops per call. The rate is the median over shapes of the faster layout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

# (label, M, K, N)
SHAPES = (
    ("qkv", 512, 896, 1152),
    ("o", 512, 896, 896),
    ("gate/up", 512, 896, 4864),
    ("gate_up", 512, 896, 9728),
    ("down", 512, 4864, 896),
)


def time_mm(m: int, k: int, n: int, layout: str, repeats: int) -> float:
    """Median seconds of one fp32 ``torch.mm`` of [m, k] x [k, n] in ``layout`` (nn or nt)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(k, n, generator=g) if layout == "nn" else torch.randn(n, k, generator=g).t()
    out = torch.empty(m, n)
    for _ in range(2):
        torch.mm(x, w, out=out)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(x, w, out=out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(threads: int, repeats: int = 10) -> dict:
    """{"threads", "shapes": [{label, m, k, n, nn, nt} GFLOP/s], "gflops": the rate}."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows = []
        for label, m, k, n in SHAPES:
            flops = 2 * m * k * n
            row = {"label": label, "m": m, "k": k, "n": n}
            for layout in ("nn", "nt"):
                row[layout] = flops / time_mm(m, k, n, layout, repeats) / 1e9
            rows.append(row)
    finally:
        torch.set_num_threads(before)
    return {"threads": threads, "shapes": rows, "gflops": statistics.median(max(r["nn"], r["nt"]) for r in rows),
            "load_average": os.getloadavg()[0]}


def format_rate(result: dict) -> str:
    lines = [f"fp32 torch.mm, {result['threads']} threads, GFLOP/s (median of timed calls; torch {torch.__version__})",
             "", "| shape | M x K x N | nn | nt (weight [N, K]) |", "|---|---|---|---|"]
    for r in result["shapes"]:
        lines.append(f"| {r['label']} | {r['m']} x {r['k']} x {r['n']} | {r['nn']:.1f} | {r['nt']:.1f} |")
    lines += ["", f"measured fp32 matmul rate: {result['gflops']:.1f} GFLOP/s "
              f"(70%: {0.7 * result['gflops']:.1f}, 75%: {0.75 * result['gflops']:.1f}; "
              f"load average {result['load_average']:.2f})"]
    if result["load_average"] > len(os.sched_getaffinity(0)) * 0.75:
        lines.append("WARNING: the machine is busy (load average near or above its core count): "
                     "this is not the CPU's rate; measure on a quiet machine")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    result = measure(args.threads, args.repeats)
    print(format_rate(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
