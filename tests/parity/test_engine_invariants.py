"""Engine-level invariants on the real stories260K model (float32, greedy).

Each test compares token ids, so any scheduling, caching or batching bug that changes a single
token fails it: golden == transformers, chunked == unchunked, prefix hit == miss, batch == single,
preempted == unpreempted.
"""

from __future__ import annotations

import json

import pytest

from tandem import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)

PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park. They saw a big tree with",
    "One day",
    "There was a girl named Sue who liked to",
    "The sun was shining and the birds",
    "Max had a red ball. He",
    "A cat",
]


@pytest.fixture(scope="module")
def golden(stories_dir):
    return json.loads((stories_dir / "golden.json").read_text())["cases"]


def make_llm(stories_dir, **kwargs) -> LLM:
    kwargs.setdefault("dtype", "float32")
    return LLM(str(stories_dir), progress=False, **kwargs)


@pytest.fixture(scope="module")
def llm(stories_dir):
    return make_llm(stories_dir)


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy outputs of each prompt run alone, unchunked, with a cold cache."""
    ref = {}
    for p in PROMPTS:
        llm.engine.scheduler.kv_cache_manager.reset_prefix_cache()
        ref[p] = llm.generate(p, GREEDY)[0].outputs[0].token_ids
    return ref


def test_golden_greedy(llm, golden):
    for case in golden:
        params = SamplingParams(temperature=0.0, max_tokens=len(case["greedy_token_ids"]), ignore_eos=True)
        out = llm.generate({"prompt_token_ids": case["prompt_token_ids"]}, params)[0]
        assert out.outputs[0].token_ids == case["greedy_token_ids"], case["prompt"]
        text_out = llm.generate(case["prompt"], params)[0] if case["prompt"] else out
        assert text_out.prompt_token_ids == case["prompt_token_ids"]
        assert text_out.outputs[0].token_ids == case["greedy_token_ids"]
        # The text is what the output adds to the decoded prompt (vLLM); golden.json's greedy_text is
        # decode(output ids) alone, so it lacks the SentencePiece space of a first word ("▁and" -> "and").
        tok = llm.get_tokenizer()
        prompt_text = tok.decode(case["prompt_token_ids"], skip_special_tokens=True)
        full = tok.decode(case["prompt_token_ids"] + case["greedy_token_ids"], skip_special_tokens=True)
        assert text_out.outputs[0].text == full[len(prompt_text) :]
        assert text_out.outputs[0].text.removeprefix(" ") == case["greedy_text"]


@pytest.mark.parametrize("chunk", [1, 3, 7, 16])
def test_chunked_prefill_matches_unchunked(stories_dir, reference, chunk):
    llm = make_llm(stories_dir, max_num_batched_tokens=chunk, enable_prefix_caching=False)
    outs = llm.generate(PROMPTS, GREEDY)
    for p, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == reference[p]


def test_prefix_cache_hit_matches_miss(stories_dir, reference):
    llm = make_llm(stories_dir, block_size=4)
    long_prompt = PROMPTS[2]
    first = llm.generate(long_prompt, GREEDY)[0]
    second = llm.generate(long_prompt, GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens > 0
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == reference[long_prompt]
    # A different tail on a shared prefix also hits and still matches its own reference.
    shared = llm.generate(PROMPTS[2] + " a", GREEDY)[0]
    cold = make_llm(stories_dir, block_size=4, enable_prefix_caching=False).generate(PROMPTS[2] + " a", GREEDY)[0]
    assert shared.num_cached_tokens > 0
    assert shared.outputs[0].token_ids == cold.outputs[0].token_ids


def test_batch_matches_single(stories_dir, reference):
    llm = make_llm(stories_dir, enable_prefix_caching=False)
    outs = llm.generate(PROMPTS, GREEDY)
    assert len(outs) == 8
    for p, out in zip(PROMPTS, outs, strict=True):
        assert out.prompt == p
        assert out.outputs[0].token_ids == reference[p]


def test_preemption_keeps_outputs(stories_dir, reference):
    # 12 blocks of 4 tokens = 48 token slots for 8 requests that each need ~70: preemption must happen.
    llm = make_llm(stories_dir, block_size=4, num_blocks=24, enable_prefix_caching=False)
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.stats().num_preemptions > 0
    for p, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == reference[p]
    kv = llm.engine.scheduler.kv_cache_manager
    assert kv.usage == 0.0
    kv.check()


def test_lpm_reordering_keeps_outputs(stories_dir, llm, reference):
    # Longest prefix hit first (scheduler/lpm.py) with an 8-token budget: the cached prompt and the two
    # extending it are admitted before the earlier, uncached ones, and every output is unchanged.
    tails = [PROMPTS[2] + " a", PROMPTS[2] + " many"]
    alone = {}
    for p in tails:
        llm.engine.scheduler.kv_cache_manager.reset_prefix_cache()
        alone[p] = llm.generate(p, GREEDY)[0].outputs[0].token_ids
    lpm = make_llm(stories_dir, block_size=4, max_num_batched_tokens=8, long_prefill_token_threshold=4,
                   max_long_partial_prefills=1, scheduling_policy="lpm")
    lpm.generate(PROMPTS[2], GREEDY)  # caches the shared prefix
    sched, admitted = lpm.engine.scheduler, []
    schedule = sched.schedule

    def spy():
        out = schedule()
        admitted.extend(n.prompt_token_ids for n in out.new_requests)
        return out

    sched.schedule = spy
    outs = lpm.generate(PROMPTS + tails, GREEDY)
    tokenizer = lpm.get_tokenizer()
    first = sorted(tokenizer.decode(t, skip_special_tokens=True) for t in admitted[:3])
    assert first == sorted([PROMPTS[2], *tails])
    assert [o.num_cached_tokens > 0 for o in outs[-2:]] == [True, True]
    assert [o.outputs[0].token_ids for o in outs] == [reference[p] for p in PROMPTS] + [alone[p] for p in tails]
