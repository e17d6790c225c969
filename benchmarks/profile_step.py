"""Where a decode step's time goes: torch.profiler over decode steps of a random-weight checkpoint.

Usage:
    python benchmarks/profile_step.py [--shape qwen2.5-0.5b] [--batch 1] [--steps 8] [--threads 2]
    python benchmarks/profile_step.py --gguf FILE.gguf [--batch 1] [--compare-threads 1]   (e.g. moe_gguf.py's files)

Builds the checkpoint (``checkpoints.make_checkpoint``; reused with ``--work-dir``), starts
``--batch`` greedy sequences, runs a few decode steps, then profiles ``--steps`` decode steps and
prints (1) the wall time per step without the profiler, (2) self CPU time per step grouped by
category, (3) the top operators. Tandem's C++ kernels are pybind functions the profiler cannot see,
so this script wraps each in a ``record_function("tandem::<name>")`` range.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoints import SHAPES, make_checkpoint  # noqa: E402

KERNELS = ("linear_bf16", "linear_bf16_packed", "linear_int8", "linear_int4", "linear_q8_0", "linear_q4_1",
           "linear_q5_0", "linear_q4_k", "linear_q6_k", "paged_attention", "rms_norm", "rotary", "silu_and_mul",
           "fused_add_rms_norm", "rotary_", "decoder_layer", "moe_bf16", "moe_int8", "moe_int4", "moe_q8_0",
           "moe_kquant")
CATEGORIES = {
    "linear": ("tandem::linear", "aten::linear", "aten::addmm", "aten::mm", "aten::matmul"),
    "MoE experts (one call per layer)": ("tandem::moe",),
    "attention": ("tandem::paged_attention", "aten::_scaled_dot_product", "aten::index_copy"),
    "sampling, casts": ("aten::max", "aten::argmax", "aten::log_softmax", "aten::_to_copy", "aten::copy_"),
    "norm/rope/act": ("tandem::rms_norm", "tandem::rotary", "tandem::silu_and_mul", "aten::silu", "aten::rsqrt",
                      "tandem::fused_add_rms_norm"),
    # one C++ call per decoder layer (its linears, attention, norms, rope, activation inside)
    "decoder layers (one call each)": ("tandem::decoder_layer",),
}


def _wrap_kernels() -> None:
    """Put a profiler range around every Tandem kernel wrapper (module attributes, patched in place)."""
    from tandem import kernels

    for name in KERNELS:
        inner = getattr(kernels, name, None)
        if inner is None:
            continue

        def wrapper(*args, _inner=inner, _name=name, **kwargs):  # noqa: ANN002, ANN003, ANN202
            with record_function(f"tandem::{_name}"):
                return _inner(*args, **kwargs)

        setattr(kernels, name, wrapper)


def _category(op: str) -> str:
    for cat, prefixes in CATEGORIES.items():
        if op.startswith(prefixes):
            return cat
    return "other ops"


def _seconds_per_step(engine, steps: int) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps


def _compare_threads(engine, steps: int, threads: int, other: int) -> None:  # noqa: ANN001
    """Prints ms per step on ``threads`` and ``other`` threads, two alternating rounds, then restores ``threads``."""
    import os

    import torch

    for rnd in range(2):
        for n in (threads, other):
            torch.set_num_threads(n)
            ms = 1e3 * _seconds_per_step(engine, steps)
            print(f"round {rnd + 1}, {n} thread(s): {ms:.1f} ms per step (load average {os.getloadavg()[0]:.1f})")
    torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=list(SHAPES))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quantization", default=None)
    p.add_argument("--work-dir")
    p.add_argument("--gguf", help="profile this GGUF file instead of a random --shape checkpoint")
    p.add_argument("--compare-threads", type=int,
                   help="also time --steps steps on this many threads, alternating twice with --threads")
    p.add_argument("--unfused", action="store_true",
                   help="run each layer's kernels from Python (per-kernel breakdown) instead of one C++ call")
    args = p.parse_args(argv)
    if args.unfused:
        from tandem.models.llama import LlamaModel

        LlamaModel.fused_step = lambda self, x: False
    from tandem.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from tandem.engine.core import EngineCore
    from tandem.models.resolve import resolve_model_path
    from tandem.request import Request
    from tandem.sampling_params import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp) / args.shape / "hf"
        hf_dir = resolve_model_path(args.gguf) if args.gguf else make_checkpoint(args.shape, work)
        model_kwargs = {"quantization": args.quantization} if args.quantization else {}
        config = EngineConfig(model=ModelConfig(model=str(hf_dir), max_model_len=1024, **model_kwargs),
                              cache=CacheConfig(kv_cache_gib=0.25),
                              scheduler=SchedulerConfig(max_num_seqs=args.batch), num_threads=args.threads)
        engine = EngineCore(hf_dir, config, progress=False)
        total = 7 * args.steps + 10
        params = SamplingParams(max_tokens=total, ignore_eos=True, temperature=0.0)
        for i in range(args.batch):
            engine.add_request(Request(request_id=str(i), prompt_token_ids=list(range(1000 + i, 1032 + i)),
                                       sampling_params=params, max_tokens=total))
        for _ in range(5):
            engine.step()
        wall = _seconds_per_step(engine, args.steps)
        if args.compare_threads:
            _compare_threads(engine, args.steps, args.threads, args.compare_threads)
        _wrap_kernels()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                engine.step()
    events = prof.key_averages()
    by_cat: dict[str, float] = defaultdict(float)
    for e in events:
        by_cat[_category(e.key)] += e.self_cpu_time_total / 1e3 / args.steps
    print(f"\n{args.gguf or args.shape}, batch {args.batch}, threads {args.threads}: {1e3 * wall:.2f} ms per decode "
          f"step without the profiler ({args.batch / wall:.1f} tokens/s)")
    print("| category | self CPU ms/step (profiled) |\n|---|---|")
    for cat, ms in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        print(f"| {cat} | {ms:.2f} |")
    print(events.table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
