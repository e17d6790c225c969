"""Real acceptance: stories260K with its real drafts on the 50 evaluation prompts (128 greedy tokens).

``drafts/eval_prompts.json`` holds the target's greedy tokens and the acceptance counts of a plain
reference loop (HF transformers). Through Tandem, in one continuous batch of all 50 prompts, the
output must be identical to the target's greedy tokens and the acceptance rate within 0.02 of the
reference. (Tandem's first token comes from the prefill step, without drafts, as in vLLM; the
reference loop already drafts from the prompt, so per-prompt counts differ slightly while the rates
agree to about 0.005.) ``benchmarks/spec_decode_acceptance.py`` prints the full table for k = 2..8.
"""

from __future__ import annotations

import json

import pytest

from tandem import LLM, SamplingParams


@pytest.fixture(scope="module")
def eval_set(stories_dir):
    path = stories_dir.parent / "drafts" / "eval_prompts.json"
    if not path.is_file():
        pytest.skip(f"{path} not found (needs ../shared beside the repo)")
    return json.loads(path.read_text())


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("draft", ["ar", "pard"])
def test_acceptance_matches_reference(stories_dir, eval_set, draft, k):
    spec = {"method": "pard" if draft == "pard" else "draft", "num_speculative_tokens": k,
            "speculative_model": str(stories_dir.parent / "drafts" / draft)}
    llm = LLM(str(stories_dir), dtype="float32", progress=False, num_threads=1, speculative_config=spec)
    prompts = eval_set["prompts"]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p["input_ids"]} for p in prompts], params)
    for out, prompt in zip(outs, prompts, strict=True):
        assert out.outputs[0].token_ids == prompt["target_greedy_ids"], prompt["text"]
    stats = llm.engine.stats()
    reference = eval_set["results"][draft]["k"][str(k)]
    assert stats.spec_acceptance_rate == pytest.approx(reference["acceptance_rate"], abs=0.02)
    # Per-request counters add up to the engine's.
    assert sum(o.outputs[0].num_accepted_tokens for o in outs) == stats.spec_num_accepted_tokens
    assert sum(o.outputs[0].num_draft_tokens for o in outs) == stats.spec_num_draft_tokens
    # After the prefill, each prompt's 127 tokens come from verification steps (accepted drafts + 1)
    # and at most one plain last step (no draft fits when one token remains).
    produced = stats.spec_num_drafts + stats.spec_num_accepted_tokens
    assert 127 * len(prompts) - len(prompts) <= produced <= 127 * len(prompts)
