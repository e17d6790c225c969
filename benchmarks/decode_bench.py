"""Decode / prefill throughput of Tandem vs transformers (and llama.cpp) on random-weight checkpoints.

Usage (see benchmarks/README.md):
    python benchmarks/decode_bench.py [--shapes qwen2.5-0.5b llama-3.2-1b] [--llama-cpp] [--repeats 3]

For each shape (``checkpoints.SHAPES``) it saves a random bf16 checkpoint with transformers, loads
every backend once, then repeats, backend after backend within each repeat (so machine load hits all
alike), and reports the median of each metric:
  decode b1   greedy tokens/s of one sequence after its first token (prompt 32 tokens, n tokens)
  b16 out     output tokens/s of 16 sequences of n tokens, prefill of their 32-token prompts included
  b16 decode  16 (n - 1) / (time of the decode steps after the first token) for those 16 sequences
  prefill     prompt tokens/s of one 512-token prompt (time to the first token)
Tandem's engine core and llama.cpp's eval loop are timed step by step; transformers' generate() as
t(n) - t(1) (it has no step API), which is noisier.
llama.cpp (``--llama-cpp``) runs in a persistent worker process of a llama-cpp-python virtualenv that
this script creates (compiling llama.cpp takes minutes the first time), on GGUF files (BF16, Q8_0)
written from the same checkpoint. ``--tandem-gguf q8_0`` adds Tandem rows that load such a GGUF file
(converted once into $TANDEM_CACHE, its Q8_0/Q4_0/Q4_1 weights kept quantized), to compare with
llama.cpp on the same file.
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

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoints import GGUF_TYPES, SHAPES, make_checkpoint, weight_bytes, write_gguf  # noqa: E402

CACHE = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))
WORKER = Path(__file__).resolve().parent / "llama_cpp_worker.py"
# --clock: wall time, or process CPU time (robust to other processes on a shared machine; meaningful
# with --threads 1 only, since with more threads it also counts spin-waiting).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


class GenerateBackend:
    """Times ``generate(prompts, max_tokens)`` (greedy, EOS ignored) of Tandem or transformers."""

    def __init__(self, name: str, generate, clock: str) -> None:  # noqa: ANN001
        self.name, self._generate, self.clock = name, generate, CLOCKS[clock]

    def seconds(self, prompts: list[list[int]], max_tokens: int) -> float:
        t0 = self.clock()
        self._generate(prompts, max_tokens)
        return self.clock() - t0

    def decode_seconds(self, prompts: list[list[int]], n: int) -> tuple[float, float]:
        """(time of n tokens, time of the n - 1 tokens after the first)."""
        first = self.seconds(prompts, 1)
        full = self.seconds(prompts, n)
        return full, full - first

    def prefill_seconds(self, prompt: list[int]) -> float:
        return self.seconds([prompt], 1)


class TandemBackend:
    """Tandem's engine core stepped directly (as the engine process does when serving): the first
    step prefills every prompt and samples its first token, the others decode. No detokenization."""

    def __init__(self, path: Path, threads: int, batch: int, quantization: str | None, clock: str,
                 name: str | None = None) -> None:
        from tandem import LLM

        self.clock = CLOCKS[clock]
        self.name = name or (f"tandem-{quantization}" if quantization else "tandem")
        kwargs = {"quantization": quantization} if quantization else {}
        llm = LLM(model=str(path), dtype="bfloat16", max_model_len=1024, kv_cache_gib=0.25, max_num_seqs=batch,
                  max_num_batched_tokens=2048, enable_prefix_caching=False, num_threads=threads, progress=False,
                  **kwargs)
        self.engine = llm.engine
        self._ids = 0

    def _add(self, prompts: list[list[int]], n: int) -> None:
        from tandem.request import Request
        from tandem.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
        for p in prompts:
            self._ids += 1
            self.engine.add_request(Request(request_id=str(self._ids), prompt_token_ids=p, sampling_params=params,
                                            max_tokens=n))

    def decode_seconds(self, prompts: list[list[int]], n: int) -> tuple[float, float]:
        """(time of n tokens per prompt, time of the n - 1 decode steps after the first token)."""
        self._add(prompts, n)
        t0 = self.clock()
        self.engine.step()  # NOTE: all prompts fit the 2048-token budget, so this step prefills them all
        t1 = self.clock()
        steps = 0
        while self.engine.has_unfinished_requests():
            self.engine.step()
            steps += 1
        t2 = self.clock()
        assert steps == n - 1, f"expected {n - 1} decode steps, ran {steps}"
        return t2 - t0, t2 - t1

    def prefill_seconds(self, prompt: list[int]) -> float:
        self._add([prompt], 1)
        t0 = self.clock()
        self.engine.step()
        elapsed = self.clock() - t0
        assert not self.engine.has_unfinished_requests()
        return elapsed


def hf_backend(path: Path, threads: int, clock: str) -> GenerateBackend:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()

    def generate(prompts: list[list[int]], max_tokens: int) -> None:
        ids = torch.tensor(prompts, dtype=torch.long)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                           min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)

    return GenerateBackend("transformers", generate, clock)


def ensure_llama_cpp_venv(venv: Path) -> Path:
    """Create ``venv`` with llama-cpp-python (compiled from source by pip) unless it imports already.

    Returns the venv's python. Raises subprocess.CalledProcessError when pip fails.
    """
    python = venv / "bin" / "python"
    if python.is_file() and subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0:
        return python
    print(f"creating {venv} and building llama-cpp-python (several minutes)...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
    subprocess.run([python, "-m", "pip", "install", "llama-cpp-python", "numpy"], check=True, env=env)
    return python


class LlamaCppBackend:
    """One llama.cpp model in a worker process (see llama_cpp_worker.py)."""

    def __init__(self, name: str, python: Path, gguf_path: Path, threads: int, clock: str) -> None:
        self.name = name
        self.proc = subprocess.Popen([str(python), str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self._ask({"cmd": "load", "path": str(gguf_path), "threads": threads, "n_ctx": 1024, "clock": clock})

    def _ask(self, msg: dict) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: llama.cpp worker exited (code {self.proc.wait()})")
        return json.loads(line)

    def decode_seconds(self, prompts: list[list[int]], n: int) -> tuple[float, float]:
        if len(prompts) != 1:
            raise ValueError("the llama.cpp worker decodes one sequence")
        s = self._ask({"cmd": "decode", "prompt": prompts[0], "n": n})["seconds"]
        return s, s

    def prefill_seconds(self, prompt: list[int]) -> float:
        return self._ask({"cmd": "prefill", "tokens": prompt})["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def measure_once(backend, metrics: dict[str, list[float]], rng: np.random.Generator, args, vocab: int,  # noqa: ANN001
                 batched: bool) -> None:
    """One repeat of every metric for ``backend``; appends tokens/s values to ``metrics``."""
    def prompt(n: int) -> list[int]:
        return rng.integers(300, vocab - 300, n).tolist()

    n = args.gen_len
    _, dec = backend.decode_seconds([prompt(args.prompt_len)], n)
    metrics.setdefault("decode b1", []).append((n - 1) / dec)
    metrics.setdefault("prefill", []).append(args.prefill_len / backend.prefill_seconds(prompt(args.prefill_len)))
    if batched:
        full, dec = backend.decode_seconds([prompt(args.prompt_len) for _ in range(args.batch)], n)
        metrics.setdefault(f"b{args.batch} out", []).append(args.batch * n / full)
        metrics.setdefault(f"b{args.batch} decode", []).append(args.batch * (n - 1) / dec)


def bench_shape(shape: str, args, work: Path) -> dict[str, dict[str, list[float]]]:  # noqa: ANN001
    hf_dir = make_checkpoint(shape, work / shape / "hf")
    vocab = SHAPES[shape]["vocab_size"]
    backends: list = []
    for q in args.tandem_quant:
        backends.append(TandemBackend(hf_dir, args.threads, args.batch, None if q == "none" else q, args.clock))
    for qtype in args.tandem_gguf:
        gguf_path = write_gguf(hf_dir, work / shape / f"model-{qtype}.gguf", qtype)
        backends.append(TandemBackend(gguf_path, args.threads, args.batch, None, args.clock,
                                      name=f"tandem GGUF {qtype.upper()}"))
    if not args.no_hf:
        backends.append(hf_backend(hf_dir, args.threads, args.clock))
    if args.llama_cpp:
        python = ensure_llama_cpp_venv(Path(args.llama_cpp_venv))
        for qtype in ("bf16", "q8_0"):
            gguf_path = write_gguf(hf_dir, work / shape / f"model-{qtype}.gguf", qtype)
            backends.append(LlamaCppBackend(f"llama.cpp {qtype.upper()}", python, gguf_path, args.threads,
                                           args.clock))
    results: dict[str, dict[str, list[float]]] = {b.name: {} for b in backends}
    rng = np.random.default_rng(0)
    for b in backends:  # warm-up: first calls pay one-off costs (allocations, kernel JIT)
        measure_once(b, {}, rng, argparse.Namespace(**{**vars(args), "gen_len": 4}), vocab, False)
    for rep in range(args.repeats):
        for b in backends:
            batched = b.name.startswith("tandem") or (args.hf_batch and b.name == "transformers")
            measure_once(b, results[b.name], rng, args, vocab, batched)
        print(f"[{shape}] repeat {rep + 1}/{args.repeats} done", flush=True)
    for b in backends:
        if isinstance(b, LlamaCppBackend):
            b.close()
    results["_weights_gb"] = {"value": [weight_bytes(hf_dir) / 1e9]}
    return results


def format_table(all_results: dict) -> str:
    """Markdown: one row per shape x metric, one column per backend (medians), ratios vs the first."""
    lines = []
    for shape, res in all_results.items():
        names = [n for n in res if not n.startswith("_")]
        metrics = list(dict.fromkeys(m for n in names for m in res[n]))
        gb = res["_weights_gb"]["value"][0]
        lines += [f"\n**{shape}** ({gb:.2f} GB of bf16 weights), tokens/s, median", "",
                  "| metric | " + " | ".join(names) + " | " + " | ".join(f"tandem / {n}" for n in names[1:]) + " |",
                  "|---" * (2 * len(names)) + "|"]
        for m in metrics:
            med = {n: statistics.median(res[n][m]) if m in res[n] else None for n in names}
            cells = [f"{med[n]:.1f}" if med[n] else "-" for n in names]
            first = med[names[0]]
            ratios = [f"{first / med[n]:.2f}x" if first and med[n] else "-" for n in names[1:]]
            lines.append(f"| {m} | " + " | ".join(cells + ratios) + " |")
        b1 = statistics.median(res[names[0]]["decode b1"])
        lines.append(f"\n{names[0]} batch-1 decode reads weights at {gb * b1:.1f} GB/s.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--gen-len", type=int, default=64, help="tokens generated per sequence")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tandem-quant", nargs="+", default=["none"], choices=["none", "int8", "int4"],
                   help="Tandem rows to measure: bf16 (none) and/or weight-only quantized")
    p.add_argument("--tandem-gguf", nargs="+", default=[], choices=list(GGUF_TYPES),
                   help="Tandem rows loading the checkpoint written as GGUF of these types (weights kept quantized)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--hf-batch", action="store_true", help="also measure transformers at --batch sequences")
    p.add_argument("--llama-cpp", action="store_true", help="also measure llama.cpp (builds a venv once)")
    p.add_argument("--llama-cpp-venv", default=str(CACHE / "bench" / "llama-cpp-venv"))
    p.add_argument("--work-dir", help="keep and reuse checkpoints here (default: a temporary folder)")
    p.add_argument("--json", help="write raw per-repeat values here")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: per-process CPU time, for --threads 1 on a machine shared with other work")
    args = p.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        p.error("--clock cpu needs --threads 1")
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp)
        all_results = {shape: bench_shape(shape, args, work) for shape in args.shapes}
    print(f"\nthreads={args.threads} clock={args.clock} gen_len={args.gen_len} prompt_len={args.prompt_len} "
          f"prefill_len={args.prefill_len} repeats={args.repeats}")
    print(format_table(all_results))
    if args.json:
        Path(args.json).write_text(json.dumps(all_results, indent=1))


if __name__ == "__main__":
    main()
