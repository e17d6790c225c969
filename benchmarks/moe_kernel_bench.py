"""The fused MoE kernels side by side in one run: bf16, int8, int4 (Q4_0), q8_0 and q4_k_m experts.

One MoE layer with Qwen3-30B-A3B's widths (hidden 2048, expert intermediate 768, 8 experts per token; ``--experts``
of them, 64 by default to fit a shared machine's memory), random weights and routing, at each ``--tokens``
count. Contenders run in rotation for ``--repeats`` rounds (a noisy machine slows them alike); printed: the median
ms per call, the best round, and GB/s of the selected experts' weight bytes (each is read once per call: the MoE
roofline counts exactly these bytes), and each format's speed-up over bf16 in the same run. ``q4_k_m`` is
llama.cpp's Q4_K_M expert mix: gate / up Q4_K, down Q6_K (``kernels.moe_kquant``).

    PYTHONPATH=$PWD python benchmarks/moe_kernel_bench.py [--tokens 1 16] [--threads 2] [--repeats 15]
                                                          [--threads 1 --clock cpu]  (on a loaded machine)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from tandem import kernels
from tandem.models.moe_quant import quantize_stack

H, I, K = 2048, 768, 8


def experts(num: int, seed: int = 0) -> dict[str, tuple[torch.Tensor, ...]]:
    """Per format, the kernel's expert tensors (``w13, w2`` for bf16, codes + scales for the others)."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.stack([torch.randn(2 * I, H, generator=g).bfloat16() * 0.02 for _ in range(num)])
    w2 = torch.stack([torch.randn(H, I, generator=g).bfloat16() * 0.02 for _ in range(num)])
    out: dict[str, tuple[torch.Tensor, ...]] = {"bf16": (w13, w2)}
    for fmt in ("int8", "int4"):
        out[fmt] = (*quantize_stack(w13, fmt), *quantize_stack(w2, fmt))
    if kernels.available("moe_q8_0"):  # a GGUF's Q8_0 codes: random int8, fp16 group scales
        out["q8_0"] = tuple(t for n, k in ((2 * I, H), (H, I)) for t in (
            torch.randint(-128, 128, (num, n, k), dtype=torch.int8, generator=g),
            (torch.rand(num, n, k // 32, generator=g) * 2e-4).half()))
    if kernels.available("moe_kquant"):  # random K-quant blocks: code bytes, small fp16 fields
        out["q4_k_m"] = tuple(t for n, k, nbytes, halves in ((2 * I, H, 140, (2,)), (H, I, 208, ())) for t in (
            torch.randint(0, 256, (num, n, k // 256 * nbytes), dtype=torch.uint8, generator=g),
            (torch.rand(num, n, k // 256, *halves, generator=g) * 1e-3).half()))
    return out


KQUANT_FORMATS = {"q4_k_m": ("q4_k", "q6_k")}  # name -> moe_kquant's (w13, w2) formats


def call_kernel(fmt: str, x: torch.Tensor, tensors: tuple[torch.Tensor, ...], weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
    if fmt in KQUANT_FORMATS:
        return kernels.moe_kquant(x, *tensors, weights, ids, *KQUANT_FORMATS[fmt])
    return getattr(kernels, f"moe_{fmt}")(x, *tensors, weights, ids)


def bytes_per_expert(tensors: tuple[torch.Tensor, ...]) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / tensors[0].shape[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: this process's CPU time, for --threads 1 on a machine shared with other work")
    args = p.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        p.error("--clock cpu needs --threads 1")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    formats = experts(args.experts)
    print(f"E={args.experts} H={H} I={I} k={K} threads={args.threads} clock={args.clock} repeats={args.repeats} "
          f"load average {os.getloadavg()[0]:.1f} (1 min) before")
    g = torch.Generator().manual_seed(1)
    for t in args.tokens:
        x = torch.randn(t, H, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(args.experts, generator=g)[:K] for _ in range(t)])
        weights = torch.softmax(torch.randn(t, K, generator=g), dim=-1)
        selected = len(set(ids.flatten().tolist()))
        calls = {fmt: (lambda fmt=fmt, x=x, weights=weights, ids=ids: call_kernel(fmt, x, formats[fmt], weights, ids))
                 for fmt in formats}
        for call in calls.values():  # warm-up
            call()
        times: dict[str, list[float]] = {fmt: [] for fmt in calls}
        for _ in range(args.repeats):
            for fmt, call in calls.items():
                t0 = clock()
                call()
                times[fmt].append(clock() - t0)
        base = statistics.median(times["bf16"])
        print(f"\ntokens={t}: {selected} experts selected")
        print("| format | median ms | best ms | GB/s of selected experts | vs bf16 |")
        print("|---|---|---|---|---|")
        for fmt, ts in times.items():
            med = statistics.median(ts)
            gbs = selected * bytes_per_expert(formats[fmt]) / med / 1e9
            print(f"| {fmt} | {med * 1e3:.2f} | {min(ts) * 1e3:.2f} | {gbs:.1f} | {base / med:.2f}x |")
    print(f"\nload average {os.getloadavg()[0]:.1f} (1 min) after")


if __name__ == "__main__":
    main()
