"""Speculative decoding speed on SmolLM2-135M (the default model): batch 1, greedy, N new tokens.

Usage: python benchmarks/spec_decode_speed.py [--max-tokens 256] [--ks 2 4 6] [--num-threads N]
                                             [--methods ngram self-quant self-quant-int4]

``ngram`` runs on prompts that ask to repeat or lightly edit a given text or code (where prompt lookup
pays off); ``self-quant`` on ordinary chat prompts. For every (method, k) it prints tokens/s against
plain decoding of the same prompts in the same run, the acceptance rate, the mean acceptance length
(tokens per verification step) and whether the text is identical to plain greedy decoding.
"""

from __future__ import annotations

import argparse
import time

from tandem import LLM, SamplingParams

CODE = '''def parse_config(path):
    with open(path) as f:
        lines = f.readlines()
    config = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config


def save_config(path, config):
    with open(path, "w") as f:
        for key, value in sorted(config.items()):
            f.write(f"{key} = {value}\\n")
'''
TEXT = ("The quick brown fox jumps over the lazy dog. The dog did not move, because it was asleep in "
        "the warm afternoon sun. Later that day, the fox came back with three friends, and together they "
        "ran around the garden until the farmer opened the door and chased them all away.")
EDIT_PROMPTS = [
    f"Rename the function parse_config to load_config everywhere in this code and print the whole "
    f"code again:\n\n{CODE}",
    f"Repeat the following text exactly, word for word:\n\n{TEXT}",
    f"Add type hints to this code and print the whole result:\n\n{CODE}",
]
CHAT_PROMPTS = [
    "Explain why the sky is blue in a few paragraphs.",
    "Write a short story about a robot who learns to paint.",
    "What are the main differences between Python lists and tuples?",
]


def generate(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[list[str], int, float]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    texts, tokens, seconds = [], 0, 0.0
    for prompt in prompts:  # NOTE: batch 1: one prompt at a time
        t0 = time.perf_counter()
        out = llm.chat([{"role": "user", "content": prompt}], params)[0].outputs[0]
        seconds += time.perf_counter() - t0
        texts.append(out.text)
        tokens += len(out.token_ids)
    return texts, tokens, seconds


def spec_config(method: str, k: int) -> dict:
    if method == "self-quant-int4":
        return {"method": "self-quant", "quantization": "int4", "num_speculative_tokens": k}
    return {"method": method, "num_speculative_tokens": k}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 6])
    parser.add_argument("--methods", nargs="+", default=["ngram", "self-quant", "self-quant-int4"])
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    # NOTE: no prefix caching: in bfloat16 a prefix hit changes the prefill shapes, and so the rounding.
    engine = {"num_threads": args.num_threads, "max_model_len": 2048, "kv_cache_gib": 0.25, "progress": False,
              "enable_prefix_caching": False}
    plain = LLM(None, **engine)
    prompts = {"ngram": EDIT_PROMPTS}
    for method in args.methods:
        method_prompts = prompts.get(method, CHAT_PROMPTS)
        generate(plain, method_prompts[:1], 8)  # warm-up
        ref_texts, ref_tokens, ref_seconds = generate(plain, method_prompts, args.max_tokens)
        print(f"plain ({'edit' if method == 'ngram' else 'chat'} prompts): {ref_tokens / ref_seconds:.1f} tok/s",
              flush=True)
        for k in args.ks:
            llm = LLM(None, speculative_config=spec_config(method, k), **engine)
            generate(llm, method_prompts[:1], 8)
            before = llm.engine.stats()
            texts, tokens, seconds = generate(llm, method_prompts, args.max_tokens)
            s = llm.engine.stats()
            drafts = s.spec_num_drafts - before.spec_num_drafts
            drafted = s.spec_num_draft_tokens - before.spec_num_draft_tokens
            accepted = s.spec_num_accepted_tokens - before.spec_num_accepted_tokens
            speedup = (tokens / seconds) / (ref_tokens / ref_seconds)
            print(f"{method:16s} k={k}: {tokens / seconds:6.1f} tok/s = {speedup:.2f}x "
                  f"plain | acceptance {accepted / max(drafted, 1):.3f} | mean acceptance length "
                  f"{1 + accepted / max(drafts, 1):.2f} | identical text {texts == ref_texts}", flush=True)


if __name__ == "__main__":
    main()
