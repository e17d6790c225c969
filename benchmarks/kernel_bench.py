"""Linear kernels side by side in one run: every compiled variant the CPU runs vs PyTorch.

For each format (bf16, int8, int4 = Q4_0, q8_0, q4_1; bf16 also as the packed weight of
``kernels.pack_bf16`` where a variant has ``linear_bf16_packed``) and token count M (1: decode, memory-bound,
printed as GB/s of weight bytes read; 16 and 512: GFLOP/s), times the kernel of each variant, the old
PyTorch path (``F.linear`` on bf16 weights, or the Python dequantization + ``F.linear``), and
``torch.mm`` in float32 on the same shape (this CPU's fp32 matmul rate, the prefill yardstick).
Contenders run in rotation, ``--repeats`` rounds, in a new random order each round (a fixed seed), so
that none always runs right after the same one (PyTorch's OpenMP threads keep spinning for a while
after its matmul returns). The median is printed (and the best
round, which on a loaded shared machine is the closest to a quiet one), so a noisy machine slows them alike.

    PYTHONPATH=$PWD python benchmarks/kernel_bench.py [--k 896 --n 4864 --threads 2 --repeats 15]

``--baseline DIR`` also times each variant built from another checkout's kernels (``DIR`` =
``/work/main``: that repository's ``tandem/kernels/csrc``), labelled ``baseline <variant>``, in the
same rotation: old and new kernels side by side in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem.kernels import build, pack_bf16
from tandem.models import quant


def weights(fmt: str, n: int, k: int) -> tuple[tuple[torch.Tensor, ...], int]:
    """The ``fmt`` tensors of a random ``[n, k]`` layer and their size in bytes."""
    w = torch.randn(n, k) * 0.02
    if fmt == "bf16":
        t = (w.bfloat16(),)
    elif fmt == "int8":
        t = quant.quantize_int8(w)
    elif fmt == "int4":
        t = quant.quantize_int4(w)
    elif fmt == "q8_0":
        t = (torch.randint(-127, 128, (n, k), dtype=torch.int8), (torch.rand(n, k // 32) * 1e-3).half())
    else:
        d = (torch.rand(n, k // 32) * 1e-3).half()
        t = (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8), torch.stack([d, -8 * d], dim=2))
    return t, sum(x.numel() * x.element_size() for x in t)


OPS = {"bf16": "linear_bf16", "int8": "linear_int8", "int4": "linear_int4", "q8_0": "linear_q8_0",
       "q4_1": "linear_q4_1"}


@contextlib.contextmanager
def sources_of(checkout: Path) -> Iterator[None]:
    """Builds and loads variants from ``checkout``'s kernel sources while inside (a digest of its own)."""
    saved = build.CSRC
    build.CSRC = checkout / "tandem" / "kernels" / "csrc"
    try:
        yield
    finally:
        build.CSRC = saved


def modules(variants: list[str], baseline: Path | None) -> dict[str, object]:
    """``{label: compiled module}``: each of ``variants`` this CPU runs, and with ``baseline`` its builds too."""
    out = {name: build.load_variant(name) for name in variants}
    if baseline is not None:
        with sources_of(baseline):
            out |= {f"baseline {name}": build.load_variant.__wrapped__(name) for name in variants}
    return {label: module for label, module in out.items() if module is not None}


def contenders(fmt: str, tensors: tuple[torch.Tensor, ...], x: torch.Tensor,
               mods: dict[str, object]) -> dict[str, Callable[[], object]]:
    out: dict[str, Callable[[], object]] = {}
    for name, module in mods.items():
        if hasattr(module, OPS[fmt]):
            fn = getattr(module, OPS[fmt])
            out[name] = lambda fn=fn: fn(x, *tensors)
        if fmt == "bf16" and hasattr(module, "linear_bf16_packed"):  # the weight packed at load (pack_linears)
            fn, packed = module.linear_bf16_packed, pack_bf16(tensors[0])
            out[f"{name} packed"] = lambda fn=fn, packed=packed: fn(x, packed)
    if fmt == "bf16":
        out["torch F.linear bf16"] = lambda: F.linear(x, tensors[0])
    else:
        out["torch dequant+F.linear"] = lambda: F.linear(x, quant.dequantize_weight(fmt, *tensors).bfloat16())
    return out


def median_times(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, tuple[float, float]]:
    """``{name: (median, best)}`` seconds per call."""
    for fn in fns.values():  # warm-up (first calls build / allocate)
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    order, rng = list(fns), random.Random(0)
    for _ in range(repeats):
        rng.shuffle(order)
        for name in order:
            fn = fns[name]
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=896)
    parser.add_argument("--n", type=int, default=4864)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--formats", default="bf16,int8,int4,q8_0,q4_1")
    parser.add_argument("--tokens", default="1,16,512")
    parser.add_argument("--variants", default=",".join(build.VARIANTS), help="compiled variants to time")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout whose kernels are timed alongside (e.g. /work/main)")
    args = parser.parse_args()
    mods = modules(args.variants.split(","), args.baseline)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    k, n = args.k, args.n
    print(f"K={k} N={n} threads={args.threads} repeats={args.repeats} (median); CPU flags: "
          f"{' '.join(f for f in ('avx2', 'fma', 'f16c', 'avx512f', 'avx512_bf16') if f in build.cpu_flags())}")
    for m in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(m, k).bfloat16()
        a, b = x.float(), torch.randn(k, n)
        fp32, fp32_best = median_times({"mm": lambda a=a, b=b: torch.mm(a, b)}, args.repeats)["mm"]
        flops = 2 * m * n * k
        print(f"\nM={m}: torch.mm fp32 [{m},{k}]x[{k},{n}] {fp32 * 1e3:.3f} ms = {flops / fp32 / 1e9:.1f} GFLOP/s "
              f"(best {flops / fp32_best / 1e9:.1f})")
        for fmt in args.formats.split(","):
            tensors, nbytes = weights(fmt, n, k)
            for name, (t, best) in median_times(contenders(fmt, tensors, x, mods), args.repeats).items():
                work, unit = (nbytes, "GB/s") if m == 1 else (flops, "GFLOP/s")
                print(f"  {fmt:5s} {name:24s} {t * 1e3:8.3f} ms  {work / t / 1e9:6.1f} {unit} "
                      f"(best {work / best / 1e9:6.1f})  {fp32 / t:.2f}x fp32 mm")


if __name__ == "__main__":
    main()
