"""Batch invariance end to end (kernels issue, item 5): on both kernel variants (avx2 everywhere,
avx512_bf16 where the CPU has it) a bf16 greedy request's tokens do not depend on what else is in the
batch or on speculation, and a seeded sampled request gives the same text when its prefix is already
cached.

The linear and attention kernels of both variants compute each (token, row) value in one fixed order
whatever the number of tokens in the step, and prompt rows go through them too (no oneDNN GEMM, no
SDPA; tests/unit/test_kernels_linear.py, test_kernels.py check the kernels bit for bit); this checks
the whole engine on the real default model (SmolLM2-135M Q4_1).
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


@pytest.fixture(scope="module", params=["avx2", "avx512_bf16"])
def avx2_llm(request, smollm2_available):  # noqa: ANN001, ANN201
    """An engine on one kernel variant (both in turn; the name is kept from when only avx2 was invariant)."""
    variant = request.param
    if build.variant_unsupported_reason(variant) is not None or build.load_variant(variant) is None:
        pytest.skip(f"{variant} kernels unavailable: {build.variant_unsupported_reason(variant) or 'build failed'}")
    saved = os.environ.get("TANDEM_KERNEL_BACKEND")
    llm = LLM(kernel_backend=variant, progress=False)
    llm.variant = variant
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
    spec = LLM(kernel_backend=avx2_llm.variant, progress=False,
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
