"""Phi-3 against transformers on tiny random checkpoints (float32; tests/conftest.py ``TINY_PHI3_MODELS``).

Fused ``qkv_proj`` / ``gate_up_proj`` checkpoint tensors, and longrope with
``original_max_position_embeddings`` O = 32: prompts longer than O (every token on the long factors) and
shorter (short factors, then the long ones from position O on). The reference for generation is
transformers' forward with a KV cache, one call per token, which picks the factors per call by the
largest position + 1, as Tandem does per token (``layers.RotaryEmbedding``); ``generate`` equals it except
that it recomputes the whole cache with the long factors when a short-prompt sequence crosses O.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY_PHI3_MODELS
from tests.parity.test_models_vs_hf import REL_TOL, _prompt, hf_greedy, make_runner, rel_err, run_greedy

NUM_NEW = 32
ORIGINAL_MAX = 32  # phi3_longrope's original_max_position_embeddings


@pytest.fixture(scope="module", params=TINY_PHI3_MODELS)
def phi3_pair(request, tiny_checkpoint_factory):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_checkpoint_factory(request.param)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return request.param, model_dir, hf_model, make_runner(model_dir, num_blocks=200)


def hf_stepwise_greedy(hf_model, prompt: list[int], num_new: int) -> list[int]:
    """Greedy tokens from transformers' forward with a ``DynamicCache``: the prompt in one call, then
    one call per token (no ``generate``, so no cache recompute at the longrope switch)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf_model.config)
    ids, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(num_new):
            logits = hf_model(ids, cache=cache, use_cache=True).logits
            out.append(int(logits[0, -1].argmax()))
            ids = torch.tensor([[out[-1]]])
    return out


@pytest.mark.parametrize("length", [45, 20])  # longer and shorter than O
def test_prompt_logits_match_transformers(phi3_pair, length) -> None:
    name, _, hf_model, runner = phi3_pair
    prompt = _prompt(length, seed=length)
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0].float()
    assert rel_err(runner.prompt_logits(prompt), ref) < REL_TOL, name
    assert rel_err(runner.prompt_logits(prompt, chunk_size=4), ref) < REL_TOL, name


def test_longrope_tables_differ_as_configured(tiny_checkpoint_factory) -> None:
    """Guards the fixture: the long factors really change the logits of a prompt longer than O."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint_factory("phi3_longrope"), dtype=torch.float32)
    prompt = _prompt(40, seed=7)
    with torch.no_grad():
        long = hf_model(torch.tensor([prompt])).logits[0, :ORIGINAL_MAX]
        short = hf_model(torch.tensor([prompt[:ORIGINAL_MAX]])).logits[0]
    assert rel_err(short, long) > 1e-2
    assert hf_model.model.rotary_emb.attention_scaling == pytest.approx(1.2649, abs=1e-4)


def test_greedy_alone_and_in_a_batch_of_8(phi3_pair) -> None:
    """Half the prompts are longer than O, half shorter (those cross O while generating)."""
    name, _, hf_model, runner = phi3_pair
    prompts = [_prompt(3 + 2 * i if i % 2 else 33 + 2 * i, seed=10 + i) for i in range(8)]
    expected = [hf_stepwise_greedy(hf_model, p, NUM_NEW) for p in prompts]
    assert len(set(map(tuple, expected))) == 8, name  # the cases really differ
    for i in (0, 1):
        assert run_greedy(runner, [prompts[i]], NUM_NEW) == [expected[i]], (name, i)
    assert run_greedy(runner, prompts, NUM_NEW, chunk=3, stagger=1) == expected, name
    for i in (0, 1):  # generate(): identical for a long prompt, and before the switch for a short one
        generated = hf_greedy(hf_model, prompts[i], NUM_NEW)
        short = name == "phi3_longrope" and len(prompts[i]) <= ORIGINAL_MAX
        before_switch = ORIGINAL_MAX - len(prompts[i]) + 1 if short else NUM_NEW
        assert generated[:before_switch] == expected[i][:before_switch], (name, i)


def test_engine_with_prefix_cache_hit(phi3_pair) -> None:
    """A long-prompt request's blocks are hit by its repeat but never by a short prompt that shares its
    first tokens (their KV was computed with the long factors)."""
    from tandem import SamplingParams
    from tandem.config import CacheConfig, EngineConfig, ModelConfig
    from tandem.engine.core import EngineCore
    from tandem.request import Request

    name, model_dir, hf_model, _ = phi3_pair
    long_prompt = _prompt(41, seed=99)  # 10 full blocks of 4, then a partial one
    short_prompt = long_prompt[:21]
    config = EngineConfig(model=ModelConfig(model=str(model_dir), dtype="float32"),
                          cache=CacheConfig(block_size=4, num_blocks=96), num_threads=1)
    core = EngineCore(model_dir, config, progress=False)
    outs = []
    for i, prompt in enumerate([long_prompt, long_prompt, short_prompt, short_prompt]):
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        request = Request(f"r{i}", list(prompt), params, max_tokens=8)
        core.add_request(request)
        while core.has_unfinished_requests():
            core.step()
        outs.append((request.output_token_ids, request.num_cached_tokens))
    long_expected, short_expected = hf_greedy(hf_model, long_prompt, 8), hf_greedy(hf_model, short_prompt, 8)
    assert outs[0] == (long_expected, 0) and outs[1][0] == long_expected and outs[1][1] >= 40, name
    short_hit = 0 if name == "phi3_longrope" else 20
    assert outs[2] == (short_expected, short_hit), name
    assert outs[3][0] == short_expected and outs[3][1] == 20, name
    assert core.scheduler.kv_cache_usage == 0.0


def test_partial_rotary_with_longrope(tiny_checkpoint_factory) -> None:
    """Phi-4-mini's ``partial_rotary_factor`` (0.5 here: 8 of 16 dims rotate) with longrope."""
    from transformers import AutoModelForCausalLM

    from tandem.models.hf_config import load_hf_config

    model_dir = tiny_checkpoint_factory("phi3_partial")
    assert load_hf_config(model_dir).rope.partial_rotary_factor == 0.5
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runner = make_runner(model_dir, num_blocks=96)
    for length in (45, 20):
        prompt = _prompt(length, seed=length + 2)
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt])).logits[0].float()
        assert rel_err(runner.prompt_logits(prompt, chunk_size=4), ref) < REL_TOL, length
    prompts = [_prompt(n, seed=n) for n in (5, 36, 9, 40)]
    expected = [hf_stepwise_greedy(hf_model, p, 16) for p in prompts]
    assert run_greedy(runner, prompts, 16, chunk=3, stagger=1) == expected


def test_phi3_config_errors(tmp_path, tiny_checkpoint_factory) -> None:
    import json
    import shutil

    from tandem.models.hf_config import CheckpointError, load_hf_config

    model_dir = tmp_path / "m"
    shutil.copytree(tiny_checkpoint_factory("phi3_longrope"), model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["rope_scaling"]["long_factor"] = cfg["rope_scaling"]["long_factor"][:5]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="short_factor / long_factor need 8 values each, got 8 / 5"):
        load_hf_config(model_dir)
    cfg["rope_scaling"]["long_factor"] = cfg["rope_scaling"]["short_factor"]
    cfg["partial_rotary_factor"] = 0.5  # now 4 factors each are expected
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="need 4 values each, got 8 / 8"):
        load_hf_config(model_dir)


def test_sliding_window_shorter_than_the_prompt(tmp_path, tiny_checkpoint_factory) -> None:
    """Phi-3's ``sliding_window`` (every layer) over the paged cache, with longrope, against transformers."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "phi3-window"
    shutil.copytree(tiny_checkpoint_factory("phi3_longrope"), model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**cfg, "sliding_window": 8}))
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runner = make_runner(model_dir, num_blocks=64)
    for length in (45, 20):
        prompt = _prompt(length, seed=length + 1)
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt])).logits[0].float()
        assert rel_err(runner.prompt_logits(prompt, chunk_size=3), ref) < REL_TOL, length
    prompt = _prompt(12, seed=3)  # crosses O = 32 while generating: compared with the stepwise forward
    assert run_greedy(runner, [prompt], 24) == [hf_stepwise_greedy(hf_model, prompt, 24)]
