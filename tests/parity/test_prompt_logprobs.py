"""Prompt logprobs (``SamplingParams.prompt_logprobs``) against transformers' log-softmax, stories260K fp32.

The engine computes them in the prefill's forward pass, chunk by chunk; chunked prefill, a cached
prefix (skipped for such requests) and n > 1 must all give transformers' values at every position.
"""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams

PROMPT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with "
          "her friends. One day, she saw a big red ball.")


@pytest.fixture(scope="module")
def llm(stories_dir):
    # NOTE: a 16-token chunk cap splits the ~40-token prompt into three prefill chunks.
    return LLM(str(stories_dir), dtype="float32", progress=False, long_prefill_token_threshold=16)


@pytest.fixture(scope="module")
def hf_logprobs(stories_dir, llm):
    from transformers import AutoModelForCausalLM

    ids = llm.get_tokenizer()(PROMPT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0]
    return ids, torch.log_softmax(logits.float(), dim=-1)


def check_against_hf(prompt_logprobs, ids, ref, num_top):
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        position = prompt_logprobs[i]
        expected = ref[i - 1]
        actual = position[ids[i]]
        assert abs(actual.logprob - expected[ids[i]].item()) < 1e-4, i
        assert actual.rank == int((expected > expected[ids[i]]).sum()) + 1
        top = torch.topk(expected, num_top)
        ranked = sorted(((lp.rank, t, lp.logprob) for t, lp in position.items() if lp.rank <= num_top))
        assert [r for r, _, _ in ranked] == list(range(1, num_top + 1))
        torch.testing.assert_close(torch.tensor([lp for *_, lp in ranked]), top.values, atol=1e-4, rtol=0)
        assert all(lp.decoded_token is not None for lp in position.values())


def test_prompt_logprobs_match_transformers_chunked(llm, hf_logprobs):
    ids, ref = hf_logprobs
    assert len(ids) > 2 * 16  # several chunks
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3))[0]
    check_against_hf(out.prompt_logprobs, ids, ref, 3)


def test_prompt_logprobs_with_a_cached_prefix_and_n(llm, hf_logprobs):
    ids, ref = hf_logprobs
    llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=2))  # fills the cache
    cached = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1))[0]
    assert cached.num_cached_tokens >= 32  # the prefix is in the cache
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=3, prompt_logprobs=0))[0]
    check_against_hf(out.prompt_logprobs, ids, ref, 0)
    assert [len(o.token_ids) for o in out.outputs] == [3, 3]
    assert out.num_cached_tokens == 0  # recomputed: cached blocks have no logits


def test_no_prompt_logprobs_unless_asked(llm):
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=2))[0]
    assert out.prompt_logprobs is None
