"""llama.cpp timing worker, run by ``decode_bench.py`` with the python of its llama-cpp-python venv.

Reads one JSON command per line on stdin, writes one JSON answer per line on stdout:
  {"cmd": "load", "path": str, "threads": int, "n_ctx": int, "clock": "wall" | "cpu"}
                                                           -> {"ok": true, "load_s": float}
  {"cmd": "prefill", "tokens": [int]}                      -> {"seconds": float}  (one batch eval)
  {"cmd": "decode", "prompt": [int], "n": int}             -> {"seconds": float}  (n - 1 greedy steps
                                                               after the first token, each one eval of
                                                               one token plus an argmax over the logits)
Times use the wall clock, or this process's CPU time with "clock": "cpu".
Imports only llama_cpp and numpy (no torch, no tandem).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from llama_cpp import Llama


def _greedy(llm: Llama) -> int:
    return int(np.argmax(llm.scores[llm.n_tokens - 1]))


def main() -> None:
    llm = None
    clock = time.perf_counter
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg["cmd"]
        if cmd == "load":
            clock = time.process_time if msg.get("clock") == "cpu" else time.perf_counter
            t0 = clock()
            llm = Llama(model_path=msg["path"], n_ctx=msg["n_ctx"], n_threads=msg["threads"],
                        n_threads_batch=msg["threads"], n_batch=512, verbose=False)
            answer = {"ok": True, "load_s": clock() - t0}
        elif cmd == "prefill":
            llm.reset()
            t0 = clock()
            llm.eval(msg["tokens"])
            answer = {"seconds": clock() - t0}
        elif cmd == "decode":
            llm.reset()
            llm.eval(msg["prompt"])
            token = _greedy(llm)
            t0 = clock()
            for _ in range(msg["n"] - 1):
                llm.eval([token])
                token = _greedy(llm)
            answer = {"seconds": clock() - t0}
        else:
            answer = {"error": f"unknown command {cmd!r}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
