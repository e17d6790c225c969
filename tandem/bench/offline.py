"""In-process throughput without HTTP: the Tandem engine (`tandem.LLM`) or transformers
`generate()` on the same batch of random token-id prompts.

One measurement = two timed `generate` calls on `batch_size` prompts of exactly `input_len` ids:
  prefill: max_tokens=1 -> prefill_s; prefill tok/s = batch * input_len / prefill_s
  full:    max_tokens=output_len with EOS ignored -> total_s
  decode tok/s = batch * (output_len - 1) / (total_s - prefill_s)   (tokens after the first)
  total tok/s  = batch * (input_len + output_len) / total_s
The time of a max_tokens=1 call (time to first token of the batch) stands for prefill. Each
backend first runs one short warm-up call on the whole batch (first calls pay one-off setup
costs); with num_iters > 1 each time is the median of that many calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

# A generate function: (prompt id lists, max_tokens) -> generated token count per prompt.
GenerateFn = Callable[[list[list[int]], int], list[int]]
# A loaded backend: its generate function, its tokenizer, and its context length in tokens (None if
# the model does not say).
Backend = tuple[GenerateFn, Any, int | None]


@dataclass(frozen=True)
class OfflineResult:
    """Throughputs in tokens/s, times in seconds, token counts as generated. decode_tok_s is None
    when it cannot be formed: output_len 1, or a full run timed no longer than the prefill run
    (noise on a busy machine; use more --num-iters)."""

    backend: str
    batch_size: int
    input_len: int
    output_len: int
    prefill_s: float
    total_s: float
    generated_tokens: int
    prefill_tok_s: float
    decode_tok_s: float | None
    output_tok_s: float
    total_tok_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def random_prompt_ids(tokenizer: Any, batch_size: int, input_len: int, seed: int) -> list[list[int]]:
    """`batch_size` lists of exactly `input_len` random non-special token ids."""
    special = set(tokenizer.all_special_ids)
    pool = np.array([i for i in range(tokenizer.vocab_size) if i not in special])
    rng = np.random.default_rng(seed)
    return [rng.choice(pool, input_len).tolist() for _ in range(batch_size)]


def _timed(generate: GenerateFn, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    counts = generate(prompts, max_tokens)
    return time.perf_counter() - t0, counts


def measure(
    backend: str, generate: GenerateFn, prompts: list[list[int]], output_len: int, num_iters: int = 1
) -> OfflineResult:
    """Warm up, then time prefill (max_tokens=1) and the full generation, each the median of
    `num_iters` calls.

    Raises ValueError if output_len or num_iters < 1, or the backend stops short of output_len
    tokens (EOS must be ignored for the numbers to mean anything).
    """
    if output_len < 1 or num_iters < 1:
        raise ValueError(f"output_len and num_iters must be >= 1, got {output_len}, {num_iters}")
    generate(prompts, 2)
    prefill_s = float(np.median([_timed(generate, prompts, 1)[0] for _ in range(num_iters)]))
    runs = [_timed(generate, prompts, output_len) for _ in range(num_iters)]
    total_s = float(np.median([t for t, _ in runs]))
    counts = runs[0][1]
    if min(counts) < output_len:
        raise ValueError(f"{backend}: a prompt stopped after {min(counts)} < {output_len} tokens")
    batch, input_len = len(prompts), len(prompts[0])
    decode_s = total_s - prefill_s
    decode_tokens = batch * (output_len - 1)
    return OfflineResult(
        backend=backend,
        batch_size=batch,
        input_len=input_len,
        output_len=output_len,
        prefill_s=prefill_s,
        total_s=total_s,
        generated_tokens=sum(counts),
        prefill_tok_s=batch * input_len / prefill_s,
        decode_tok_s=decode_tokens / decode_s if decode_tokens and decode_s > 0 else None,
        output_tok_s=sum(counts) / total_s,
        total_tok_s=batch * (input_len + output_len) / total_s,
    )


def tandem_backend(model: str | None, dtype: str, num_threads: int | None) -> Backend:
    """(generate fn, tokenizer, max_model_len) over `tandem.LLM`; greedy, EOS ignored."""
    from tandem import LLM, SamplingParams

    kwargs = {"num_threads": num_threads} if num_threads else {}
    llm = LLM(model=model, dtype=dtype, **kwargs)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [len(o.outputs[0].token_ids) for o in outs]

    return generate, llm.get_tokenizer(), int(llm.engine.max_model_len)


def resolve_hf_dir(model: str | None) -> str:
    """An HF folder for transformers: the model itself, or the converted GGUF / default model
    from Tandem's model resolver. Raises ImportError when no resolver module exists yet."""
    try:
        from tandem.models.resolve import resolve_model_path
    except ImportError:
        from tandem.models.gguf_convert import resolve_model_path
    return str(resolve_model_path(model))


def hf_backend(model: str | None, dtype: str, num_threads: int | None) -> Backend:
    """(generate fn, tokenizer, max_position_embeddings) over transformers `generate()`; greedy,
    EOS suppressed by min_new_tokens = max_new_tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if num_threads:
        torch.set_num_threads(num_threads)
    path = resolve_hf_dir(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def generate(prompts: list[list[int]], max_tokens: int) -> list[int]:
        ids = torch.tensor(prompts, dtype=torch.long)
        with torch.inference_mode():
            out = hf_model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
        return [out.shape[1] - ids.shape[1]] * ids.shape[0]

    return generate, tokenizer, getattr(hf_model.config, "max_position_embeddings", None)


def check_context(backend: str, input_len: int, output_len: int, context: int | None) -> None:
    """Raise ValueError when a prompt plus its output cannot fit the model's context: the engine
    would stop short (or transformers run past the trained length) and the numbers mean nothing."""
    if context is not None and input_len + output_len > context:
        raise ValueError(f"{backend}: input {input_len} + output {output_len} > context {context} of the "
                         "model; lower --input-len or --output-len")


BACKENDS = {"tandem": tandem_backend, "hf": hf_backend}


def run_offline(
    backends: list[str],
    model: str | None,
    input_len: int,
    output_len: int,
    batch_size: int,
    dtype: str = "bfloat16",
    seed: int = 0,
    num_threads: int | None = None,
    num_iters: int = 1,
) -> list[OfflineResult]:
    """Measure each backend on the same prompts (built with the first backend's tokenizer).

    Raises ValueError for an unknown backend, non-positive sizes, or input_len + output_len over a
    backend's context (checked right after loading it, before any generation).
    """
    for name, value in (("input-len", input_len), ("output-len", output_len), ("batch-size", batch_size),
                        ("num-iters", num_iters)):
        if value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; choose from {sorted(BACKENDS)}")
    results: list[OfflineResult] = []
    prompts: list[list[int]] | None = None
    for name in backends:
        generate, tokenizer, context = BACKENDS[name](model, dtype, num_threads)
        check_context(name, input_len, output_len, context)
        if prompts is None:
            prompts = random_prompt_ids(tokenizer, batch_size, input_len, seed)
        results.append(measure(name, generate, prompts, output_len, num_iters))
        del generate
    return results


def format_offline(results: list[OfflineResult]) -> str:
    """Markdown table, plus a ratio row (first / second) when two backends ran."""
    cols = ["prefill_tok_s", "decode_tok_s", "output_tok_s", "total_tok_s", "prefill_s", "total_s"]
    lines = ["| backend | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    def cell(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    for r in results:
        lines.append(f"| {r.backend} | " + " | ".join(cell(getattr(r, c)) for c in cols) + " |")
    if len(results) == 2:
        a, b = results
        ratios = [getattr(a, c) / getattr(b, c) if getattr(a, c) and getattr(b, c) else None for c in cols]
        lines.append(f"| {a.backend}/{b.backend} | " + " | ".join(cell(x) for x in ratios) + " |")
    return "\n".join(lines)
