"""Speculative greedy == plain greedy, token for token, for every method, inside continuous batching.

Tiny random checkpoints (no tokenizer: requests go to EngineCore as token ids) and the real
stories260K with its real drafts (``drafts/ar``, ``drafts/pard``). Batches mix speculating rows and
rows that opted out (``SamplingParams(speculative=False)``); the engine runs with stop strings,
max_tokens landing inside an accepted run, preemption under a tiny KV pool, chunked prefill and
prefix-cache hits, and the KV pool must be empty afterwards.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tandem.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from tandem.engine.core import EngineCore
from tandem.request import Request

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
TINY_PROMPTS = [[1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 40, 41], [1, 9, 9, 9, 9, 9, 9, 9], [1, 77, 3, 12, 3, 12, 3]]


def run_core(model_dir: Path, prompts: list[list[int]], params: list[SamplingParams],
             spec: SpeculativeConfig | None = None, num_blocks: int = 64, budget: int = 256) -> tuple:
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget), num_threads=1, speculative=spec,
    )
    core = EngineCore(model_dir, config, progress=False)
    requests = [Request(f"r{i}", list(p), sp, eos_token_ids=frozenset({2}), max_tokens=sp.max_tokens)
                for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    for r in requests:
        core.add_request(r)
    while core.has_unfinished_requests():
        core.step()
    core.scheduler.check()
    assert core.scheduler.kv_cache_usage == 0.0
    return [r.output_token_ids for r in requests], core


@pytest.fixture(scope="module")
def tiny_reference(tiny_llama_dir):
    outs, _ = run_core(tiny_llama_dir, TINY_PROMPTS, [GREEDY] * len(TINY_PROMPTS))
    return outs


def tiny_spec(method: str, factory, target: Path) -> SpeculativeConfig:
    if method == "draft-self":  # the target as its own draft: nearly every draft is accepted
        return SpeculativeConfig(method="draft", speculative_model=str(target), num_speculative_tokens=5)
    if method == "draft-other":  # another tiny checkpoint with the same vocabulary: mostly rejected
        return SpeculativeConfig(method="draft", speculative_model=str(factory("qwen2")), num_speculative_tokens=3)
    if method == "pard":
        return SpeculativeConfig(method="pard", speculative_model=str(factory("llama3_rope")),
                                 pard_mask_token_id=0, num_speculative_tokens=4)
    if method.startswith("self-quant"):
        return SpeculativeConfig(method="self-quant", quantization=method.split("-")[-1], num_speculative_tokens=4)
    return SpeculativeConfig(method="ngram", ngram_min=1, ngram_max=3, num_speculative_tokens=4)


@pytest.mark.parametrize("method", ["ngram", "draft-self", "draft-other", "pard", "self-quant-int8",
                                    "self-quant-int4"])
def test_tiny_greedy_matches_plain_in_mixed_batch(method, tiny_llama_dir, tiny_checkpoint_factory, tiny_reference):
    spec = tiny_spec(method, tiny_checkpoint_factory, tiny_llama_dir)
    params = [GREEDY, GREEDY.clone(speculative=False), GREEDY, GREEDY.clone(speculative=False)]
    outs, core = run_core(tiny_llama_dir, TINY_PROMPTS, params, spec)
    assert outs == tiny_reference
    stats = core.stats()
    assert stats.spec_num_drafts > 0 and sum(stats.spec_num_accepted_tokens_per_pos) == stats.spec_num_accepted_tokens
    if method == "draft-self":
        assert stats.spec_acceptance_rate > 0.9


def test_tiny_every_architecture_self_quant(tiny_model_name, tiny_checkpoint_factory):
    model_dir = tiny_checkpoint_factory(tiny_model_name)
    params = [GREEDY] * 2
    plain, _ = run_core(model_dir, TINY_PROMPTS[:2], params)
    spec = SpeculativeConfig(method="self-quant", num_speculative_tokens=3)
    outs, core = run_core(model_dir, TINY_PROMPTS[:2], params, spec)
    assert outs == plain
    assert core.stats().spec_acceptance_rate > 0.3


def test_tiny_preemption_chunking_and_max_tokens(tiny_llama_dir, tiny_checkpoint_factory):
    # 10 blocks of 4 tokens for 8 requests of up to 35 tokens: preemption; a budget of 5 chunks
    # prompts and trims drafts; max_tokens 1..13 end inside accepted runs.
    prompts = TINY_PROMPTS * 2
    params = [GREEDY.clone(max_tokens=m) for m in (1, 2, 3, 5, 8, 13, 24, 7)]
    plain, _ = run_core(tiny_llama_dir, prompts, params)
    spec = SpeculativeConfig(method="draft", speculative_model=str(tiny_llama_dir), num_speculative_tokens=4)
    outs, core = run_core(tiny_llama_dir, prompts, params, spec, num_blocks=10)
    assert outs == plain and core.stats().num_preemptions > 0
    outs, core = run_core(tiny_llama_dir, prompts, params, spec, budget=5)
    assert outs == plain and core.stats().spec_num_drafts > 0
    assert [len(o) for o in outs] == [1, 2, 3, 5, 8, 13, 24, 7]


# ---- the real stories260K with its real drafts ----

PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park. They saw a big tree with",
    "One day",
    "There was a girl named Sue who liked to",
    "The sun was shining and the birds",
]
STORY_GREEDY = SamplingParams(temperature=0.0, max_tokens=48)


def stories_spec(stories_dir: Path, method: str, k: int = 4) -> dict:
    drafts = stories_dir.parent / "drafts"
    return {
        "ngram": {"method": "ngram"},
        "ar": {"method": "draft", "speculative_model": str(drafts / "ar")},
        "pard": {"method": "pard", "speculative_model": str(drafts / "pard")},
        "self-quant": {"method": "self-quant"},
    }[method] | {"num_speculative_tokens": k}


def make_llm(stories_dir: Path, method: str | None = None, **kwargs) -> LLM:
    spec = stories_spec(stories_dir, method) if method else None
    return LLM(str(stories_dir), dtype="float32", progress=False, num_threads=1, speculative_config=spec, **kwargs)


@pytest.fixture(scope="module")
def plain_llm(stories_dir):
    return make_llm(stories_dir, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def stories_reference(plain_llm):
    return [o.outputs[0] for o in plain_llm.generate(PROMPTS, STORY_GREEDY)]


@pytest.mark.parametrize("method", ["ngram", "ar", "pard", "self-quant"])
def test_stories_greedy_matches_plain_alone_and_mixed(stories_dir, stories_reference, method):
    llm = make_llm(stories_dir, method)
    alone = llm.generate(PROMPTS[2], STORY_GREEDY)[0].outputs[0]
    assert alone.token_ids == stories_reference[2].token_ids and alone.text == stories_reference[2].text
    mixed = [STORY_GREEDY.clone(speculative=i % 2 == 0) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, mixed)
    for out, ref, params in zip(outs, stories_reference, mixed, strict=True):
        assert out.outputs[0].token_ids == ref.token_ids
        assert (out.outputs[0].num_draft_tokens > 0) == params.speculative or method == "ngram"
    assert llm.engine.stats().spec_acceptance_rate > (0.02 if method == "ngram" else 0.3)


def test_stories_stop_strings_and_max_tokens(stories_dir, plain_llm):
    llm = make_llm(stories_dir, "ar")
    cases = [SamplingParams(temperature=0.0, max_tokens=m) for m in (1, 2, 3, 6, 11)]
    cases += [SamplingParams(temperature=0.0, max_tokens=64, stop=stop) for stop in (["."], ["park", "tree"], [","])]
    for params in cases:
        ref = plain_llm.generate(PROMPTS[:4], params)
        outs = llm.generate(PROMPTS[:4], params)
        for out, r in zip(outs, ref, strict=True):
            o, p = out.outputs[0], r.outputs[0]
            assert (o.text, o.finish_reason, o.stop_reason) == (p.text, p.finish_reason, p.stop_reason)
            # NOTE: tokens after a stop string inside a multi-token step are dropped, so the ids
            # equal plain decoding's even then.
            assert o.token_ids == p.token_ids
            if not params.stop:
                assert len(o.token_ids) == params.max_tokens


@pytest.mark.parametrize("method", ["ar", "pard"])
def test_stories_preemption_chunking_prefix_cache(stories_dir, stories_reference, method):
    tiny_pool = make_llm(stories_dir, method, block_size=4, num_blocks=24, enable_prefix_caching=False)
    outs = tiny_pool.generate(PROMPTS, STORY_GREEDY)
    assert tiny_pool.engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [r.token_ids for r in stories_reference]
    chunked = make_llm(stories_dir, method, max_num_batched_tokens=7, enable_prefix_caching=False)
    outs = chunked.generate(PROMPTS, STORY_GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [r.token_ids for r in stories_reference]
    cached = make_llm(stories_dir, method, block_size=4)
    first = cached.generate(PROMPTS[2], STORY_GREEDY)[0]
    second = cached.generate(PROMPTS[2], STORY_GREEDY)[0]
    assert second.num_cached_tokens > 0
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == stories_reference[2].token_ids
    # The draft's KV came through the prefix hit too: acceptance is as good as on the cold run.
    assert second.outputs[0].num_accepted_tokens == first.outputs[0].num_accepted_tokens


def test_stories_logprobs_match_plain(stories_dir, plain_llm):
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2)
    ref = plain_llm.generate(PROMPTS[0], params)[0].outputs[0]
    out = make_llm(stories_dir, "ar").generate(PROMPTS[0], params)[0].outputs[0]
    assert out.token_ids == ref.token_ids and len(out.logprobs) == 24
    for o, r in zip(out.logprobs, ref.logprobs, strict=True):
        assert o.keys() == r.keys()
        for token in o:
            assert o[token].rank == r[token].rank
            assert o[token].logprob == pytest.approx(r[token].logprob, abs=1e-4)
    assert out.cumulative_logprob == pytest.approx(ref.cumulative_logprob, abs=1e-3)


@pytest.mark.parametrize("method", ["ngram", "ar", "pard"])
def test_stories_seeded_sampling_is_reproducible(stories_dir, method):
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, max_tokens=40, seed=1234)
    llm = make_llm(stories_dir, method)
    alone = llm.generate(PROMPTS[0], params)[0].outputs[0]
    batch = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[3]], [params, params.clone(seed=9), params.clone(seed=None)])
    again = make_llm(stories_dir, method).generate(PROMPTS[0], params)[0].outputs[0]
    assert alone.token_ids == batch[0].outputs[0].token_ids == again.token_ids
    assert alone.num_draft_tokens > 0


def test_tiny_sampled_joint_distribution_matches_target(tiny_llama_dir):
    """End to end: token 1 comes from the prefill, token 2 from verifying a sampled int4 self-draft
    (q close to p but not equal: about a quarter of the drafts are rejected, so the residual
    resampling matters). Their joint histogram over 1500 seeded requests must follow the target's
    filtered distribution p(t1) p(t2 | t1) (chi-square, 9 cells with top-k 3, 99.9 % quantile;
    resampling from p instead of max(0, p - q) gives a statistic near 180)."""
    from tandem.sample.sampler import filtered_probs

    prompt = [1, 17, 33]
    params = SamplingParams(temperature=0.9, top_k=3, max_tokens=3, ignore_eos=True)  # 1 draft at step 2
    spec = SpeculativeConfig(method="self-quant", quantization="int4", num_speculative_tokens=2)
    seeded = [params.clone(seed=i) for i in range(1500)]
    outs, core = run_core(tiny_llama_dir, [prompt] * len(seeded), seeded, spec, num_blocks=4096, budget=4096)
    stats = core.stats()
    assert stats.spec_num_drafts == len(seeded) and 0.5 < stats.spec_acceptance_rate < 0.95
    runner = core.runner
    p1 = filtered_probs(runner.prompt_logits(prompt)[-1:].clone(), [params])[0]
    counts: dict[tuple[int, int], int] = {}
    for out in outs:
        counts[tuple(out[:2])] = counts.get(tuple(out[:2]), 0) + 1
    stat, cells = 0.0, 0
    for t1 in p1.nonzero().flatten().tolist():
        p2 = filtered_probs(runner.prompt_logits(prompt + [t1])[-1:].clone(), [params])[0]
        for t2 in p2.nonzero().flatten().tolist():
            expected = float(p1[t1] * p2[t2]) * len(outs)
            stat += (counts.pop((t1, t2), 0) - expected) ** 2 / expected
            cells += 1
    assert not counts, f"tokens outside the target's top-k: {counts}"
    assert cells == 9 and stat < 26.12, stat


@pytest.mark.parametrize("method", ["ngram", "ar"])
def test_stories_penalties_and_min_tokens_match_plain(stories_dir, plain_llm, method):
    """Verified positions see the drafts before them as output: penalties and min_tokens stay exact."""
    params = [SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=40, frequency_penalty=0.8, presence_penalty=0.4),
              SamplingParams(temperature=0.0, max_tokens=40, min_tokens=30)]
    ref = plain_llm.generate(PROMPTS[:3], params)
    outs = make_llm(stories_dir, method).generate(PROMPTS[:3], params)
    for out, r in zip(outs, ref, strict=True):
        assert out.outputs[0].token_ids == r.outputs[0].token_ids


def test_tiny_penalties_inside_accepted_runs(tiny_llama_dir):
    """With the target as its own draft whole runs are accepted, so a token repeated inside one run
    must already be penalized at its second position (as plain decoding penalizes it)."""
    params = [GREEDY.clone(repetition_penalty=1.8), GREEDY.clone(frequency_penalty=1.5),
              GREEDY.clone(presence_penalty=1.5), GREEDY.clone(min_tokens=20, ignore_eos=False)]
    plain, _ = run_core(tiny_llama_dir, TINY_PROMPTS, params)
    spec = SpeculativeConfig(method="draft", speculative_model=str(tiny_llama_dir), num_speculative_tokens=5)
    outs, core = run_core(tiny_llama_dir, TINY_PROMPTS, params, spec)
    assert outs == plain and core.stats().spec_num_accepted_tokens > 0


def test_draft_with_another_tokenizer_is_rejected(stories_dir, tmp_path):
    import json

    draft = stories_dir.parent / "drafts" / "ar"
    for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((draft / name).read_bytes())
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]  # swap two ids: same size, other tokenizer
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match="different tokenizer"):
        LLM(str(stories_dir), dtype="float32", progress=False,
            speculative_config={"method": "draft", "speculative_model": str(tmp_path), "num_speculative_tokens": 2})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(stories_dir), dtype="float32", progress=False,
            speculative_config={"method": "draft", "speculative_model": str(tmp_path / "nope")})


def test_vllm_speculative_config_keys(stories_dir, stories_reference):
    """vLLM's ``speculative_config`` names (``model``, ``prompt_lookup_min/max``) run unchanged (they were a
    TypeError); an unknown key, or one given under both names, is a ConfigError naming it."""
    drafts = stories_dir.parent / "drafts"
    llm = LLM(str(stories_dir), dtype="float32", progress=False, num_threads=1,
              speculative_config={"method": "draft", "model": str(drafts / "ar"), "num_speculative_tokens": 3})
    assert llm.config.speculative.speculative_model == str(drafts / "ar")
    outs = llm.generate(PROMPTS, STORY_GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [r.token_ids for r in stories_reference]
    assert all(o.outputs[0].num_draft_tokens > 0 for o in outs)
    ngram = SpeculativeConfig.from_dict({"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 3})
    assert (ngram.ngram_min, ngram.ngram_max) == (2, 3)
    with pytest.raises(ConfigError, match="unknown speculative_config key 'draft_tensor_parallel'"):
        SpeculativeConfig.from_dict({"method": "ngram", "draft_tensor_parallel": 1})
    with pytest.raises(ConfigError, match="gives 'ngram_max' twice"):
        SpeculativeConfig.from_dict({"method": "ngram", "ngram_max": 3, "prompt_lookup_max": 3})
