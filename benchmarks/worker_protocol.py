"""The line protocol of decode_bench.py's peer workers (llama.cpp, vLLM CPU, AMD PACE).

Each worker runs in its peer's virtualenv and imports only the standard library from here. It reads
one JSON command per line on stdin and writes one JSON answer per line on stdout:
  {"cmd": "load", "clock": "wall" | "cpu", ...worker options}  -> {"ok": true, "load_s": float, "info": str}
  {"cmd": "prefill", "tokens": [int]}                           -> {"seconds": float}  (time to the first token)
  {"cmd": "decode", "prompts": [[int]], "n": int}               -> {"full": float, "decode": float}
      greedy, EOS ignored, n tokens per prompt: "full" is the time of all n tokens (prefill included),
      "decode" the time of the n - 1 steps after the first token
Any failure is answered as {"error": "..."} (a failed "load" then ends the worker).

The protocol gets a private copy of the original stdout; file descriptor 1 is pointed at stderr, so
whatever the peer's libraries print (vLLM logs to stdout) cannot corrupt the answers.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def serve(worker) -> None:  # noqa: ANN001 (an object with load / prefill / decode methods)
    """Answer commands until stdin closes. ``worker.clock`` is set from the load command's "clock"."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg.get("cmd")
        loading = cmd == "load"
        try:
            if loading:
                worker.clock = time.process_time if msg.get("clock") == "cpu" else time.perf_counter
                t0 = worker.clock()
                info = worker.load(msg)
                answer = {"ok": True, "load_s": worker.clock() - t0, "info": info or ""}
            elif cmd == "prefill":
                answer = {"seconds": worker.prefill(msg["tokens"])}
            elif cmd == "decode":
                full, dec = worker.decode(msg["prompts"], msg["n"])
                answer = {"full": full, "decode": dec}
            else:
                answer = {"error": f"unknown command {cmd!r}"}
        except Exception as e:  # noqa: BLE001 (reported to the benchmark, which prints it)
            traceback.print_exc()
            answer = {"error": f"{type(e).__name__}: {e}".strip()}
        proto.write(json.dumps(answer) + "\n")
        if loading and "error" in answer:
            return
