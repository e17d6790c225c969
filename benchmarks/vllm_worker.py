"""vLLM CPU timing worker, run by ``decode_bench.py`` with the python of its vLLM virtualenv.

Protocol: ``worker_protocol.py``. Load options: "path" (a Hugging Face folder), "n_ctx", "max_seqs",
"dtype". The parent sets vLLM's CPU environment before starting this process (it is read at import):
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core runs in this process, so ``LLMEngine.step()`` is
one scheduler step here), ``VLLM_CPU_KVCACHE_SPACE`` (GiB), ``VLLM_CPU_OMP_THREADS_BIND`` (the cores,
one OpenMP thread each) and ``LD_PRELOAD`` of the venv's libiomp5.

Timing steps the offline ``LLM``'s engine as Tandem's bench steps its engine core: requests are
added (token ids, greedy, EOS ignored, no detokenization), then ``step()`` runs until every request
has its first token (prefill; "full" starts here) and on until all have finished ("decode" is the
time after the last first token).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker_protocol import serve  # noqa: E402


class VllmWorker:
    clock = None  # set by serve()

    def load(self, msg: dict) -> str:
        import torch
        import vllm
        from vllm import LLM

        self.llm = LLM(model=msg["path"], dtype=msg.get("dtype", "bfloat16"), max_model_len=msg["n_ctx"],
                       max_num_seqs=msg["max_seqs"], max_num_batched_tokens=2048, enable_prefix_caching=False,
                       seed=0)
        self.engine = self.llm.llm_engine
        self._ids = 0
        return (f"vllm {vllm.__version__}, torch {torch.__version__}, "
                f"avx512_bf16={torch.cpu._is_avx512_bf16_supported()}")

    def _params(self, n: int):  # noqa: ANN202
        from vllm import SamplingParams

        return SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0, detokenize=False)

    def _run(self, prompts: list[list[int]], n: int) -> tuple[float, float]:
        params = self._params(n)
        ids = []
        for p in prompts:
            self._ids += 1
            ids.append(str(self._ids))
            self.engine.add_request(ids[-1], {"prompt_token_ids": p}, params)
        started: set[str] = set()
        t0 = self.clock()
        while len(started) < len(ids):
            for out in self.engine.step():
                if out.outputs and len(out.outputs[0].token_ids) > 0:
                    started.add(out.request_id)
            if not self.engine.has_unfinished_requests():
                break
        t1 = self.clock()
        while self.engine.has_unfinished_requests():
            self.engine.step()
        t2 = self.clock()
        return t2 - t0, t2 - t1

    def prefill(self, tokens: list[int]) -> float:
        return self._run([tokens], 1)[0]

    def decode(self, prompts: list[list[int]], n: int) -> tuple[float, float]:
        return self._run(prompts, n)


if __name__ == "__main__":
    serve(VllmWorker())
