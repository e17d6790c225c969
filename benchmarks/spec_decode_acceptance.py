"""Acceptance of the real stories260K drafts through Tandem vs the reference loop in eval_prompts.json.

Usage: python benchmarks/spec_decode_acceptance.py [--ks 2 4 6 8] [--drafts ar pard]

All 50 evaluation prompts run as one continuous batch (greedy, float32, 128 new tokens, no EOS stop).
Prints, per (draft, k): identical outputs, Tandem's acceptance rate and tokens per verification step,
the reference's, and how many prompts have exactly the reference's per-prompt accepted count (Tandem's
first token comes from the plain prefill step, as in vLLM, so per-prompt counts may shift slightly).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tandem import LLM, SamplingParams

SHARED = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"


def run(draft: str, k: int, data: dict, num_threads: int) -> str:
    spec = {"method": "pard" if draft == "pard" else "draft", "num_speculative_tokens": k,
            "speculative_model": str(SHARED / "drafts" / draft)}
    llm = LLM(str(SHARED / "hf"), dtype="float32", progress=False, num_threads=num_threads, speculative_config=spec)
    prompts = data["prompts"]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p["input_ids"]} for p in prompts], params)
    seconds = time.perf_counter() - t0
    identical = sum(o.outputs[0].token_ids == p["target_greedy_ids"] for o, p in zip(outs, prompts, strict=True))
    same_counts = sum(o.outputs[0].num_accepted_tokens == p["per_k"][draft][str(k)]["accepted"]
                      for o, p in zip(outs, prompts, strict=True))
    s = llm.engine.stats()
    ref = data["results"][draft]["k"][str(k)]
    per_pos = ", ".join(f"{c / s.spec_num_drafts:.3f}" for c in s.spec_num_accepted_tokens_per_pos)
    return (f"{draft:4s} k={k}: identical {identical}/50 | acceptance {s.spec_acceptance_rate:.4f} "
            f"(ref {ref['acceptance_rate']:.4f}, diff {s.spec_acceptance_rate - ref['acceptance_rate']:+.4f}) | "
            f"tokens/verify step {s.spec_mean_acceptance_length:.3f} (ref {ref['tokens_per_target_step']:.3f}) | "
            f"accepted {s.spec_num_accepted_tokens} of {s.spec_num_draft_tokens} (ref {ref['accepted']} of "
            f"{ref['proposed']}) | same per-prompt count {same_counts}/50 | per position [{per_pos}] | "
            f"{seconds:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 6, 8])
    parser.add_argument("--drafts", nargs="+", default=["ar", "pard"], choices=["ar", "pard"])
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads (tiny model: 1 is fastest)")
    args = parser.parse_args()
    data = json.loads((SHARED / "drafts" / "eval_prompts.json").read_text())
    for draft in args.drafts:
        for k in args.ks:
            print(run(draft, k, data, args.num_threads), flush=True)


if __name__ == "__main__":
    main()
