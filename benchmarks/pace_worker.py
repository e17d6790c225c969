"""AMD PACE timing worker, run by ``decode_bench.py`` with the python of its amd-pace virtualenv.

Only started where the CPU has avx512f and avx512_bf16 (PACE 1.3 requires them); elsewhere the
benchmark prints "needs AVX-512 BF16" instead.

Protocol: ``worker_protocol.py``. Load options: "path" (a Hugging Face folder), "threads", "dtype",
"kv_cache" (a ``pace.llm.KVCacheType`` value: dynamic, bmc, slab_pool, paged); operator backends are
PACE's defaults (``OperatorConfig().finalize``: TPP linears / MLP / LM head, JIT norm, and the cache type's
attention). The environment (threads, OpenMP wait policy) is set by ``peers.pace_backend``.

PACE's offline API (``pace.llm.LLMModel(path, dtype=..., kv_cache_type=...)``, then
``generate(token ids [B, L], SamplingConfig(...))``) runs one batch to completion: a prefill
(``Generator._prefill_forward``) and then one ``Generator._decode_forward`` per token. The worker
wraps ``_decode_forward`` to note when the first decode step starts: "full" is the whole
``generate`` call, "decode" the time from the first decode step to the end (n - 1 steps). All
prompts of a batch have the same length (no padding). ``min_new_tokens = max_new_tokens = n``
keeps EOS from ending a sequence early; a call that ran other than n - 1 decode steps, or returned other
than n new tokens per prompt, is an error.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker_protocol import serve  # noqa: E402


class PaceWorker:
    clock = None  # set by serve()

    def load(self, msg: dict) -> str:
        import pace
        import torch
        from pace.llm import KVCacheType, LLMModel

        torch.set_num_threads(msg["threads"])
        dtype = getattr(torch, msg.get("dtype", "bfloat16"))
        self.model = LLMModel(msg["path"], dtype=dtype, kv_cache_type=KVCacheType(msg.get("kv_cache", "dynamic")),
                              disable_tqdm=True)
        generator = self.model.generator
        decode_forward = generator._decode_forward
        self._first_decode = None

        def timed_decode_forward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if self._first_decode is None:
                self._first_decode = self.clock()
            self._steps += 1
            return decode_forward(*args, **kwargs)

        generator._decode_forward = timed_decode_forward
        return f"amd-pace {pace.__version__}, torch {torch.__version__}, threads {torch.get_num_threads()}"

    def _generate(self, prompts: list[list[int]], n: int) -> tuple[float, float]:
        import torch
        from pace.llm import SamplingConfig

        config = SamplingConfig(max_new_tokens=n, min_new_tokens=n, ignore_eos=True, do_sample=False)
        ids = torch.tensor(prompts, dtype=torch.long)
        self._first_decode, self._steps = None, 0
        t0 = self.clock()
        out = self.model.generate(ids, config)
        t2 = self.clock()
        t1 = self._first_decode if self._first_decode is not None else t2
        shape = tuple(out.output_token_ids.shape)
        if self._steps != n - 1 or shape != (len(prompts), len(prompts[0]) + n):
            raise RuntimeError(f"PACE ran {self._steps} decode steps, output {shape}; expected {n - 1} steps, "
                               f"output {(len(prompts), len(prompts[0]) + n)}")
        return t2 - t0, t2 - t1

    def prefill(self, tokens: list[int]) -> float:
        return self._generate([tokens], 1)[0]

    def decode(self, prompts: list[list[int]], n: int) -> tuple[float, float]:
        return self._generate(prompts, n)


if __name__ == "__main__":
    serve(PaceWorker())
