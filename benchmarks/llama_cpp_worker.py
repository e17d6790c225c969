"""llama.cpp timing worker, run by ``decode_bench.py`` with the python of its llama-cpp-python venv.

Protocol: ``worker_protocol.py``. Load options: "path" (a GGUF file), "threads", "n_ctx". One sequence
("prompts" of length 1): n - 1 greedy steps after the first token, each one eval of one token plus an argmax
over the logits; prefill is one batch eval of the prompt. Several sequences: llama.cpp's own batched decoding
(its ``batched`` example: one ``llama_batch`` of every prompt, each on its own sequence id, then one batch of
one token per sequence per step) on a second context with a unified KV cache of ``n_ctx`` per sequence.
The load answer's "info" is ``llama_print_system_info()`` (shows the instruction sets it was built
with, e.g. ``AVX2 = 1``). Imports only llama_cpp and numpy (no torch, no tandem).
"""

from __future__ import annotations

import sys
from pathlib import Path

import llama_cpp as lc
import numpy as np
from llama_cpp import Llama, llama_print_system_info

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker_protocol import serve  # noqa: E402


class LlamaCppWorker:
    clock = None  # set by serve()

    batched = None  # (n_seq, context) of the multi-sequence decode, made on first use

    def load(self, msg: dict) -> str:
        self.threads, self.n_ctx = msg["threads"], msg["n_ctx"]
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

    def _context(self, n_seq: int):  # noqa: ANN202 (a llama_context_p)
        if self.batched is None or self.batched[0] != n_seq:
            params = lc.llama_context_default_params()
            params.n_ctx, params.n_batch, params.n_ubatch = n_seq * self.n_ctx, 2048, 512
            params.n_seq_max, params.kv_unified = n_seq, True
            params.n_threads = params.n_threads_batch = self.threads
            ctx = lc.llama_init_from_model(self.llm._model.model, params)
            if not ctx:
                raise RuntimeError(f"llama_init_from_model failed for {n_seq} sequences")
            self.batched = (n_seq, ctx)
        return self.batched[1]

    def _decode_batch(self, ctx, batch, items: list[tuple[int, int, int, bool]]) -> list[int]:  # noqa: ANN001
        """One llama_decode of ``items`` (token, position, sequence, logits wanted); the argmax of each row
        that wants logits, in order."""
        for i, (token, pos, seq, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        batch.n_tokens = len(items)
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        vocab = self.llm.n_vocab()
        return [int(np.argmax(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(vocab,))))
                for i, item in enumerate(items) if item[3]]

    def decode_many(self, prompts: list[list[int]], n: int) -> tuple[float, float]:
        ctx = self._context(len(prompts))
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        batch = lc.llama_batch_init(max(sum(map(len, prompts)), len(prompts)), 0, len(prompts))
        try:
            t0 = self.clock()
            tokens = self._decode_batch(ctx, batch, [(t, i, s, i == len(p) - 1) for s, p in enumerate(prompts)
                                                     for i, t in enumerate(p)])
            t1 = self.clock()
            for step in range(n - 1):
                tokens = self._decode_batch(ctx, batch, [(t, len(p) + step, s, True)
                                                         for s, (t, p) in enumerate(zip(tokens, prompts, strict=True))])
            t2 = self.clock()
        finally:
            lc.llama_batch_free(batch)
        return t2 - t0, t2 - t1

    def decode(self, prompts: list[list[int]], n: int) -> tuple[float, float]:
        if len(prompts) > 1:
            return self.decode_many(prompts, n)
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
