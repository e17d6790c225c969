"""Mixture-of-experts families against transformers on tiny random checkpoints (float32).

Every position's logits within 1e-4 relative, chunked prefill, 32 greedy tokens alone and in a
staggered batch of 8 with 3-token prefill chunks, and through the offline engine with a prefix-cache
hit. The checkpoints are described in tests/conftest.py (``TINY_MOE_MODELS``).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY_MOE_MODELS
from tests.parity.test_models_vs_hf import REL_TOL, TINY_VOCAB, hf_greedy, make_runner, rel_err, run_greedy

NUM_NEW = 32


@pytest.fixture(scope="module", params=TINY_MOE_MODELS)
def moe_pair(request, tiny_checkpoint_factory):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_checkpoint_factory(request.param)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return request.param, model_dir, hf_model, make_runner(model_dir, num_blocks=160)


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, TINY_VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prompt_logits_match_transformers(moe_pair) -> None:
    name, _, hf_model, runner = moe_pair
    prompt = _prompt(45, seed=1)
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0].float()
    assert rel_err(runner.prompt_logits(prompt), ref) < REL_TOL, name
    assert rel_err(runner.prompt_logits(prompt, chunk_size=4), ref) < REL_TOL, name


def test_greedy_alone_and_in_a_batch_of_8(moe_pair) -> None:
    name, _, hf_model, runner = moe_pair
    prompts = [_prompt(3 + 2 * i, seed=10 + i) for i in range(8)]
    expected = [hf_greedy(hf_model, p, NUM_NEW) for p in prompts]
    assert len(set(map(tuple, expected))) == 8, name  # the cases really differ
    assert run_greedy(runner, [prompts[0]], NUM_NEW) == [expected[0]], name
    assert run_greedy(runner, prompts, NUM_NEW, chunk=3, stagger=1) == expected, name


def test_engine_with_prefix_cache_hit(moe_pair) -> None:
    from tandem import SamplingParams
    from tandem.config import CacheConfig, EngineConfig, ModelConfig
    from tandem.engine.core import EngineCore
    from tandem.request import Request

    name, model_dir, hf_model, _ = moe_pair
    prompt = _prompt(37, seed=99)  # 9 full blocks of 4, then a partial one
    expected = hf_greedy(hf_model, prompt, 16)
    config = EngineConfig(model=ModelConfig(model=str(model_dir), dtype="float32"),
                          cache=CacheConfig(block_size=4, num_blocks=64), num_threads=1)
    core = EngineCore(model_dir, config, progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = []
    for i in range(2):  # the second request finds the first one's blocks in the prefix cache
        request = Request(f"r{i}", list(prompt), params, max_tokens=16)
        core.add_request(request)
        while core.has_unfinished_requests():
            core.step()
        outs.append((request.output_token_ids, request.num_cached_tokens))
    assert outs[0] == (expected, 0), name
    assert outs[1][0] == expected and outs[1][1] >= 32, name
    assert core.scheduler.kv_cache_usage == 0.0


@pytest.mark.parametrize(("name", "quantization"), [("qwen2_moe", None), ("mixtral", None), ("qwen3_moe", "int4"),
                                                    ("mixtral", "int8")])
def test_bf16_greedy_does_not_depend_on_the_batch(name, quantization, tiny_checkpoint_factory) -> None:
    """bf16 (the kernels' dtype): a request's greedy tokens alone == inside a staggered batch of 8; with
    ``quantization`` the experts are int8 / int4 codes (``QuantizedExperts``, kernels.moe_int8 / moe_int4)."""
    from tandem.config import CacheConfig, EngineConfig, ModelConfig
    from tandem.models.moe_quant import QuantizedExperts
    from tandem.worker.model_runner import ModelRunner

    model_dir = tiny_checkpoint_factory(name)
    config = EngineConfig(model=ModelConfig(model=str(model_dir), dtype="bfloat16", quantization=quantization),
                          cache=CacheConfig(block_size=4, num_blocks=160), num_threads=1)
    runner = ModelRunner(model_dir, config, progress=False)
    runner.initialize_kv_cache(160)
    experts = [m for m in runner.model.modules() if isinstance(m, QuantizedExperts)]
    # qwen3_moe's H = 64 and I = 32 take int4; Mixtral's I = 48 is not a multiple of 32: int8
    assert [m.method for m in experts] == ([quantization] * 2 if quantization else []), name
    prompts = [_prompt(3 + 2 * i, seed=10 + i) for i in range(8)]
    num_new = 24 if quantization is None else 12
    alone = [run_greedy(runner, [p], num_new)[0] for p in prompts]
    assert len(set(map(tuple, alone))) == 8
    assert run_greedy(runner, prompts, num_new, chunk=3, stagger=1) == alone, name
