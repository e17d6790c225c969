"""Per-call time of the paged attention and elementwise kernels vs the PyTorch code they replace.

Usage:
    python benchmarks/kernel_bench_attention.py [--variant avx2] [--threads 1] [--repeats 15]
        [--clock wall|cpu] [--dtype bfloat16 float32] [--only attention elementwise window]

Attention, one layer of the Qwen2.5-0.5B shape (14 query heads, 2 KV heads, head_dim 64, blocks of
16 tokens, shuffled block ids), columns side by side in one run:
  kernel     ``build.load_variant(variant).paged_attention`` (writes K/V, attends every row)
  torch_ref  ``TorchRefAttention``: index_copy into the cache, gather, SDPA with a causal mask
             (the PyTorch path a model takes when no kernel variant runs)
  sdpa       prefill rows only: ``F.scaled_dot_product_attention(is_causal=True)`` on the new q/k/v
             (what ``CpuPagedAttention`` does for long prompt rows on ``avx512_bf16``)
Rows: decode (1 query) at contexts 64 .. 2048, decode of 16 sequences at context 512, a 5-query
speculative row, a 512-token prompt row, and a 512-token chunk after a 512-token cached prefix.
Window (``paged_attention_ex``, avx2): decode at context 2048 and a 512-token chunk after 1536 cached
tokens, with a sliding window of 256 and with soft-capping (cap 50), vs the same kernel without them
and ``TorchRefAttention`` with them.
Elementwise (one token, and 512 tokens; hidden 896, MLP 4864): rms_norm, fused_add_rms_norm,
rotary_ on the q/k columns of a fused qkv output, silu_and_mul, vs the layers' PyTorch path.

Each case runs the implementations alternately within every repeat (A/B side by side) and prints
the median microseconds per call; on a shared machine compare columns of one run only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tandem.attention import AttentionMetadata, TorchRefAttention
from tandem.attention.torch_ref import write_kv_cache
from tandem.kernels import build
from tandem.models import layers

HEADS, KV, HEAD_DIM, BLOCK = 14, 2, 64, 16


CLOCK = time.perf_counter  # --clock cpu: time.process_time


def median_us(fns: dict[str, Callable[[], object]], repeats: int, min_time: float = 0.02) -> dict[str, float]:
    """Median microseconds per call of each function, the functions interleaved within each repeat."""
    calls = {}
    for name, fn in fns.items():  # warm up, and find how many calls fill min_time seconds
        fn()
        t0 = time.perf_counter()
        fn()
        calls[name] = max(1, int(min_time / max(time.perf_counter() - t0, 1e-7)))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = CLOCK()
            for _ in range(calls[name]):
                fn()
            times[name].append((CLOCK() - t0) / calls[name] * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def attention_case(computed: list[int], scheduled: list[int], dtype: torch.dtype, seed: int = 0):  # noqa: ANN201
    """Caches holding ``computed[r]`` keys per row, and one step of ``scheduled[r]`` new tokens per row."""
    g = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in zip(computed, scheduled, strict=True)]
    num_blocks = sum(-(-n // BLOCK) for n in lens)
    ids = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[ids.pop() for _ in range(-(-n // BLOCK))] for n in lens]
    caches = tuple(torch.zeros(num_blocks, BLOCK, KV, HEAD_DIM, dtype=dtype) for _ in range(2))
    if sum(computed):
        prefix = AttentionMetadata.build([0] * len(lens), computed, tables, BLOCK)
        write_kv_cache(*(torch.randn(sum(computed), KV, HEAD_DIM, generator=g).to(dtype) for _ in range(2)), *caches,
                       prefix.slot_mapping)
    meta = AttentionMetadata.build(computed, scheduled, tables, BLOCK)
    t = sum(scheduled)
    q, k, v = (torch.randn(t, h, HEAD_DIM, generator=g).to(dtype) for h in (HEADS, KV, KV))
    return q, k, v, caches, meta


def attention_fns(module, q, k, v, caches, meta, scale: float, prefill: bool) -> dict[str, Callable]:  # noqa: ANN001
    """The implementations of one attention case, each a no-argument call."""
    out = torch.empty_like(q)
    fns = {
        "kernel": lambda: module.paged_attention(out, q, k, v, *caches, meta.slot_mapping, meta.block_tables,
                                                 meta.seq_lens, meta.query_start_loc, scale, 1 << 62),
        "torch_ref": lambda: TorchRefAttention()(q, k, v, *caches, meta, scale),
    }
    if prefill:
        qt, kt, vt = (x.transpose(0, 1) for x in (q, k, v))
        fns["sdpa"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    return fns


def bench_attention(module, dtype: torch.dtype, repeats: int) -> None:  # noqa: ANN001
    cases = [(f"decode ctx {c}", [c - 1], [1]) for c in (64, 256, 1024, 2048)]
    cases += [("decode 16 seqs ctx 512", [511] * 16, [1] * 16), ("5-query row ctx 1024", [1019], [5]),
              ("prefill 512", [0], [512]), ("chunk 512 after 512", [512], [512])]
    scale = HEAD_DIM**-0.5
    print(f"\nattention, {str(dtype).removeprefix('torch.')}, {HEADS}/{KV} heads, head_dim {HEAD_DIM}, "
          f"block {BLOCK} (median us per call)")
    print(f"{'case':<26}{'kernel':>10}{'torch_ref':>11}{'sdpa':>10}{'ref/kernel':>12}")
    for name, computed, scheduled in cases:
        fns = attention_fns(module, *attention_case(computed, scheduled, dtype), scale, prefill=computed == [0])
        us = median_us(fns, repeats)
        sdpa = f"{us['sdpa']:>10.1f}" if "sdpa" in us else f"{'-':>10}"
        print(f"{name:<26}{us['kernel']:>10.1f}{us['torch_ref']:>11.1f}{sdpa}{us['torch_ref'] / us['kernel']:>11.1f}x")


def bench_window(module, dtype: torch.dtype, repeats: int) -> None:  # noqa: ANN001
    """Sliding window 256 / soft-cap 50 in the kernel vs the kernel without them and the torch reference."""
    if not hasattr(module, "paged_attention_ex"):
        print("\nwindow: this variant has no paged_attention_ex")
        return
    scale = HEAD_DIM**-0.5
    print(f"\nwindow 256 / softcap 50, {str(dtype).removeprefix('torch.')} (median us per call)")
    print(f"{'case':<32}{'full':>10}{'kernel':>10}{'torch_ref':>11}{'full/kernel':>13}")
    for name, computed, scheduled in (("decode ctx 2048", [2047], [1]), ("chunk 512 after 1536", [1536], [512])):
        for label, window, cap in (("window 256", 256, 0.0), ("softcap 50", 0, 50.0)):
            q, k, v, caches, meta = attention_case(computed, scheduled, dtype)
            out = torch.empty_like(q)
            args = (out, q, k, v, *caches, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                    scale, 1 << 62)
            us = median_us({"full": lambda a=args: module.paged_attention(*a),
                            "kernel": lambda a=args, w=window, c=cap: module.paged_attention_ex(*a, w, c),
                            "torch_ref": lambda a=args[1:6], m=meta, w=window or None, c=cap or None:
                            TorchRefAttention()(*a, m, scale, w, c)}, repeats)
            print(f"{name + ', ' + label:<32}{us['full']:>10.1f}{us['kernel']:>10.1f}{us['torch_ref']:>11.1f}"
                  f"{us['full'] / us['kernel']:>12.2f}x")


HIDDEN, INTERMEDIATE = 896, 4864


def elementwise_fns(module, norm: layers.RMSNorm, tokens: int, dtype: torch.dtype) -> dict[str, tuple]:  # noqa: ANN001
    """Per op: (kernel call, the layers' PyTorch path) on ``tokens`` rows, each a no-argument call."""
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    res = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    gate_up = torch.randn(tokens, 2 * INTERMEDIATE, generator=g).to(dtype)
    qkv = torch.randn(tokens, (HEADS + 2 * KV) * HEAD_DIM, generator=g).to(dtype)
    qk = qkv[:, : (HEADS + KV) * HEAD_DIM].view(tokens, HEADS + KV, HEAD_DIM)
    rope = layers.RotaryEmbedding(HEAD_DIM, 4096, layers.RopeConfig())
    cos, sin = rope(torch.arange(tokens) + 100, dtype)
    x1, x2 = x.clone(), x.clone()
    return {
        "rms_norm": (lambda: module.rms_norm(x, norm.weight, 1e-6), lambda: torch_path(norm, x)),
        "fused_add_rms_norm": (lambda: module.fused_add_rms_norm(x1, res.clone(), norm.weight, 1e-6),
                               lambda: torch_path(norm, x2, res.clone())),
        "rotary_ (q and k)": (lambda: module.rotary_(qk, cos, sin),
                              lambda: torch_path(layers.apply_rotary_, qk, cos, sin)),
        "silu_and_mul": (lambda: module.silu_and_mul(gate_up), lambda: torch_path(layers.SiluAndMul(), gate_up)),
    }


def bench_elementwise(module, dtype: torch.dtype, repeats: int) -> None:  # noqa: ANN001
    norm = layers.RMSNorm(HIDDEN, 1e-6, dtype)
    norm.weight.data.fill_(1.1)
    print(f"\nelementwise, {str(dtype).removeprefix('torch.')} (median us per call, PyTorch = the layers' own code)")
    print(f"{'op':<30}{'kernel':>10}{'PyTorch':>10}{'speed-up':>10}")
    for tokens in (1, 512):
        ops = elementwise_fns(module, norm, tokens, dtype)
        for name, (kernel, reference) in ops.items():
            us = median_us({"kernel": kernel, "torch": reference}, repeats)
            print(f"{name + f' x{tokens}':<30}{us['kernel']:>10.1f}{us['torch']:>10.1f}"
                  f"{us['torch'] / us['kernel']:>9.1f}x")


def torch_path(fn: Callable, *args: object) -> object:
    """``fn(*args)`` with the layers' kernel path switched off (their PyTorch code)."""
    saved = layers._use_kernels
    layers._use_kernels = lambda *a: False
    try:
        return fn(*args)
    finally:
        layers._use_kernels = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="avx2", choices=list(build.VARIANTS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: process CPU time (steadier on a shared machine; meaningful with --threads 1)")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    parser.add_argument("--only", nargs="+", default=["attention", "elementwise", "window"],
                        choices=["attention", "elementwise", "window"])
    args = parser.parse_args()
    module = build.load_variant(args.variant)
    if module is None:
        reason = build.variant_unsupported_reason(args.variant) or "the build failed"
        raise SystemExit(f"the {args.variant} kernels cannot run here: {reason}")
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    print(f"variant {args.variant}, {args.threads} thread(s), {args.clock} clock, torch {torch.__version__}, "
          f"repeats {args.repeats}")
    for dtype in (getattr(torch, d) for d in args.dtype):
        if "attention" in args.only:
            bench_attention(module, dtype, args.repeats)
        if "elementwise" in args.only:
            bench_elementwise(module, dtype, args.repeats)
        if "window" in args.only:
            bench_window(module, dtype, args.repeats)


if __name__ == "__main__":
    main()
