"""llama.cpp timing worker, run by ``decode_bench.py`` with the python of its llama-cpp-python venv.

Protocol: ``worker_protocol.py``. Load options: "path" (a GGUF file), "threads", "n_ctx". Decodes
one sequence per command ("prompts" of length 1): n - 1 greedy steps after the first token, each
one eval of one token plus an argmax over the logits; prefill is one batch eval of the prompt.
The load answer's "info" is ``llama_print_system_info()`` (shows the instruction sets it was built
with, e.g. ``AVX2 = 1``). Imports only llama_cpp and numpy (no torch, no tandem).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from llama_cpp import Llama, llama_print_system_info

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker_protocol import serve  # noqa: E402


class LlamaCppWorker:
    clock = None  # set by serve()

    def load(self, msg: dict) -> str:
        self.llm = Llama(model_path=msg["path"], n_ctx=msg["n_ctx"], n_threads=msg["threads"],
                         n_threads_batch=msg["threads"], n_batch=512, verbose=False)
        info = llama_print_system_info()
        return info.decode() if isinstance(info, bytes) else str(info)

    def _greedy(self) -> int:
        # NOTE: llama-cpp-python 0.3.x no longer copies logits into ``Llama.scores`` unless logits_all (that row
        # stayed 0, so every step fed token 0: the same experts each step in a MoE model); read the context's.
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))
        return int(np.argmax(logits))

    def prefill(self, tokens: list[int]) -> float:
        self.llm.reset()
        t0 = self.clock()
        self.llm.eval(tokens)
        return self.clock() - t0

    def decode(self, prompts: list[list[int]], n: int) -> tuple[float, float]:
        if len(prompts) != 1:
            raise ValueError("the llama.cpp worker decodes one sequence")
        self.llm.reset()
        t0 = self.clock()
        self.llm.eval(prompts[0])
        token = self._greedy()
        t1 = self.clock()
        for _ in range(n - 1):
            self.llm.eval([token])
            token = self._greedy()
        t2 = self.clock()
        return t2 - t0, t2 - t1


if __name__ == "__main__":
    serve(LlamaCppWorker())
