"""Batch invariance end to end (kernels issue, item 5): on the avx2 kernels a bf16 greedy request's
tokens do not depend on what else is in the batch or on speculation, and a seeded sampled request
gives the same text when its prefix is already cached.

The avx2 linear and attention kernels compute each (token, row) value in one fixed order whatever
the number of tokens in the step (tests/unit/test_kernels_linear.py, test_kernels.py check the
kernels bit for bit); this checks the whole engine on the real default model (SmolLM2-135M Q4_1).
The avx512_bf16 variant is not batch-invariant (its small-M and tiled paths reduce in different
orders, and prompt rows use SDPA), so the test selects avx2, which every AVX-512 CPU also runs.
"""

from __future__ import annotations

import os

import pytest

from tandem import LLM, SamplingParams
from tandem.kernels import build

PROMPTS = [
    "Answer in one sentence: what is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Name a famous painter.",
    "Give me a tip for learning to code.",
]


@pytest.fixture(scope="module")
def avx2_llm(smollm2_available):  # noqa: ANN001, ANN201
    if build.variant_unsupported_reason("avx2") is not None or build.load_variant("avx2") is None:
        pytest.skip(f"avx2 kernels unavailable: {build.variant_unsupported_reason('avx2') or 'build failed'}")
    saved = os.environ.get("TANDEM_KERNEL_BACKEND")
    llm = LLM(kernel_backend="avx2", progress=False)
    yield llm
    if saved is None:
        os.environ.pop("TANDEM_KERNEL_BACKEND", None)
    else:
        os.environ["TANDEM_KERNEL_BACKEND"] = saved
    build.selected_variant.cache_clear()


def _chat(llm: LLM, prompts: list[str], params: SamplingParams) -> list[list[int]]:
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_greedy_tokens_alone_equal_batch_of_8_and_ngram_speculation(avx2_llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=16)
    alone = [_chat(avx2_llm, [p], greedy)[0] for p in PROMPTS]
    assert all(len(t) > 0 for t in alone)
    assert _chat(avx2_llm, PROMPTS, greedy) == alone
    spec = LLM(kernel_backend="avx2", progress=False,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert _chat(spec, PROMPTS, greedy) == alone
    assert spec.engine.stats().spec_num_drafts > 0  # speculation really ran


def test_seeded_sample_is_the_same_with_its_prefix_cached(avx2_llm: LLM) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=24)
    first = _chat(avx2_llm, PROMPTS[:1], params)[0]
    hits = avx2_llm.engine.stats().prefix_cache_hits
    second = _chat(avx2_llm, PROMPTS[:1], params)[0]
    assert avx2_llm.engine.stats().prefix_cache_hits > hits  # the second prompt hit the cache
    assert second == first
