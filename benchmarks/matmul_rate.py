"""This CPU's measured fp32 matmul rate: GFLOP/s of ``torch.mm`` at prefill-like shapes.

Usage:
    python benchmarks/matmul_rate.py [--threads 2] [--repeats 10] [--json out.json]
                                     [--tandem qwen2.5-0.5b|PATH [--rounds 3] [--work-dir DIR]]

The reference for issue 11's "prefill uses fp32 GEMM at >= 70% of this CPU's measured fp32 matmul
rate": M = 512 tokens times the Qwen2.5-0.5B linears (K x N: qkv 896 x 1152, o 896 x 896, gate/up
896 x 4864, fused gate_up 896 x 9728, down 4864 x 896). Each shape is timed in two layouts:
``nn`` = ``torch.mm(x [M, K], w [K, N])`` and ``nt`` = ``torch.mm(x, w [N, K].t())`` (a checkpoint's
weight layout, what ``F.linear`` does); per shape the median of ``--repeats`` timed calls after two
warm-up calls, 2 * M * K * N flops per call. The rate is the median over shapes of the faster layout.

``--tandem``: Tandem's own rate on a bf16 checkpoint (a ``checkpoints.SHAPES`` name: a random checkpoint
of that shape, or a local HF folder), in the same run: ``--rounds`` rounds, each the torch.mm rate
above, then one 512-token prefill (the engine step that prefills the prompt and samples its first
token) and 16 sequences' decode steps (32-token prompts, 16 tokens each; the steps after the first),
timed by ``bench_backends.TandemBackend``. Flops counted: prefill 2 * P * 512 with P the decoder layers'
linear weights (q, k, v, o, gate, up, down; 358M for Qwen2.5-0.5B); a 16-sequence decode step
2 * (P + vocab * hidden) * 16 (the LM head runs on all 16 rows). Not counted: attention scores,
norms, RoPE, the prefill's one LM-head row. The table gives each as a fraction of the round's rate
(issue 11's goals: prefill >= 0.70, 16 sequences >= 0.75); medians over rounds.
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


def linear_params(config: dict) -> tuple[int, int]:
    """(decoder layers' linear weights, LM head weights) of an HF ``config.json`` dict (dense models)."""
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    d = config.get("head_dim") or h // heads
    per_layer = h * heads * d * 2 + 2 * h * kv_heads * d + 3 * h * i
    return per_layer * layers, config["vocab_size"] * h


def measure_tandem(model: str, threads: int, rounds: int, repeats: int, work: Path) -> dict:
    """Rounds of (torch.mm rate, Tandem prefill GFLOP/s, Tandem 16-sequence decode GFLOP/s); see the docstring."""
    import sys

    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_backends import TandemBackend
    from checkpoints import SHAPES, make_checkpoint

    path = make_checkpoint(model, work / model / "hf") if model in SHAPES else Path(model)
    config = json.loads((path / "config.json").read_text())
    layer_params, head_params = linear_params(config)
    backend = TandemBackend(path, threads, 16, None, "wall")
    rng = np.random.default_rng(0)

    def prompt(n: int) -> list[int]:
        return rng.integers(300, config["vocab_size"] - 300, n).tolist()

    backend.prefill_seconds(prompt(64))  # warm-up: kernels loaded, buffers allocated
    backend.decode_seconds([prompt(32) for _ in range(16)], 2)
    out = {"params": layer_params, "head_params": head_params, "rounds": []}
    for _ in range(rounds):
        rate = measure(threads, repeats)["gflops"]
        load = os.getloadavg()[0]
        prefill = 2 * layer_params * 512 / backend.prefill_seconds(prompt(512)) / 1e9
        _, dec = backend.decode_seconds([prompt(32) for _ in range(16)], 16)
        decode = 2 * (layer_params + head_params) * 16 * 15 / dec / 1e9
        out["rounds"].append({"rate": rate, "prefill": prefill, "decode16": decode, "load": load,
                              "load_after": os.getloadavg()[0]})
    return out


def format_tandem(result: dict) -> str:
    lines = [f"\nTandem on a bf16 checkpoint ({result['params'] / 1e6:.0f}M layer linear weights, "
             f"{result['head_params'] / 1e6:.0f}M LM head), GFLOP/s against the same round's fp32 torch.mm rate",
             "", "| round | torch.mm rate | prefill 512 | / rate | 16-seq decode | / rate | load |",
             "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(result["rounds"]):
        lines.append(f"| {i + 1} | {r['rate']:.1f} | {r['prefill']:.1f} | {r['prefill'] / r['rate']:.2f} | "
                     f"{r['decode16']:.1f} | {r['decode16'] / r['rate']:.2f} | {r['load']:.2f}-{r['load_after']:.2f} |")
    med = {k: statistics.median(r[k] / r["rate"] for r in result["rounds"]) for k in ("prefill", "decode16")}
    lines.append(f"\nmedian over rounds: prefill {med['prefill']:.2f}x the fp32 matmul rate (goal >= 0.70), "
                 f"16 sequences {med['decode16']:.2f}x (goal >= 0.75)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", help="write the result here")
    p.add_argument("--tandem", metavar="SHAPE|PATH", help="also Tandem's prefill / 16-sequence rate on this bf16 model")
    p.add_argument("--rounds", type=int, default=3, help="with --tandem: interleaved rounds")
    p.add_argument("--work-dir", help="with --tandem: keep the random checkpoint here (default: a temporary folder)")
    args = p.parse_args(argv)
    result = measure(args.threads, args.repeats)
    print(format_rate(result))
    if args.tandem:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            result["tandem"] = measure_tandem(args.tandem, args.threads, args.rounds, args.repeats,
                                              Path(args.work_dir or tmp))
        print(format_tandem(result["tandem"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
