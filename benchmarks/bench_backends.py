"""The in-process contenders of ``decode_bench.py``: Tandem's engine core stepped directly and transformers'
``generate()``, each timed by ``--clock`` (wall time or this process's CPU time)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

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
