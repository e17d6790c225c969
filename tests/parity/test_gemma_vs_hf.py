"""Gemma2, Gemma3 (text) and Mistral with a sliding window, against transformers on tiny random checkpoints.

Every checkpoint has a sliding window of 8 tokens, far shorter than the sequences (45-token prompts,
up to 49 tokens with the generated ones), so a window that is ignored or misplaced changes the
logits. Soft-capping caps are small (attention 2, final 5) so that the tanh really bends the values.
float32: every position's logits within 1e-4 relative, alone and in 4-token prefill chunks, on the
default attention backend (the avx2 kernel here) and on the torch reference; 32 greedy tokens alone and
in a staggered batch of 8 with 3-token chunks; through the engine with a prefix-cache hit and
speculative decoding (the checkpoint as its own draft, so 1 + k query rows are verified every step);
in bfloat16, greedy tokens alone == in a batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.attention import TorchRefAttention
from tests.parity.test_models_vs_hf import (
    REL_TOL,
    TINY_VOCAB,
    _prompt,
    hf_greedy,
    make_runner,
    rel_err,
    run_greedy,
)

NUM_NEW = 32
WINDOW = 8
_COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
               bos_token_id=1, eos_token_id=2, pad_token_id=0, sliding_window=WINDOW)
# gemma2: layers sliding / full / sliding, both soft-caps, query_pre_attn_scalar != head_dim.
# gemma3: q/k norms, local rope 10k on the sliding layers, global rope 1e6 with linear scaling x4.
# mistral_window: MistralForCausalLM's window in every layer; qwen2_window: use_sliding_window from layer 1 on.
MODELS = ("gemma2", "gemma3", "mistral_window")


def _config(name: str):
    import transformers as tf

    if name == "gemma2":
        return tf.Gemma2Config(**_COMMON, num_hidden_layers=3, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                               final_logit_softcapping=5.0)
    if name == "gemma3":
        return tf.Gemma3TextConfig(**_COMMON, num_hidden_layers=3, query_pre_attn_scalar=24,
                                   final_logit_softcapping=5.0,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                    "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                       "rope_theta": 1e6}})
    if name == "qwen2_window":
        return tf.Qwen2Config(**_COMMON, num_hidden_layers=3, use_sliding_window=True, max_window_layers=1,
                              tie_word_embeddings=False)
    return tf.MistralConfig(**_COMMON, num_hidden_layers=2, tie_word_embeddings=False)


def build_checkpoint(name: str, out_dir: Path) -> Path:
    """A random tiny ``name`` checkpoint (seed 0) saved with transformers' own classes into ``out_dir``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(name), dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):  # Gemma scales by 1 + weight, the others by weight
                p.copy_((0.0 if name.startswith("gemma") else 1.0) + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``get(name) -> Path``: each checkpoint of ``MODELS`` built once per module."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_checkpoint(name, tmp_path_factory.mktemp(f"tiny-{name}"))
        return built[name]

    return get


@pytest.fixture(scope="module", params=MODELS)
def pair(request, checkpoint):
    from transformers import AutoModelForCausalLM

    model_dir = checkpoint(request.param)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return request.param, model_dir, hf_model, make_runner(model_dir, num_blocks=160)


def test_checkpoints_have_the_cases(pair) -> None:
    """Guards the fixture: sliding layers where the family puts them, the caps, the two ropes."""
    from tandem.models.hf_config import load_hf_config

    name, model_dir, _, runner = pair
    cfg = load_hf_config(model_dir)
    expected = {"gemma2": (WINDOW, None, WINDOW), "gemma3": (WINDOW, None, WINDOW), "mistral_window": (WINDOW,) * 2}
    assert cfg.layer_windows == expected[name]
    assert [layer.self_attn.sliding_window for layer in runner.model.model.layers] == list(expected[name])
    if name == "gemma2":
        caps = (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.attention_multiplier)
        assert caps == (2.0, 5.0, 24**-0.5)
    if name == "gemma3":
        assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping == 5.0
        assert (cfg.rope.rope_type, cfg.rope.factor, cfg.rope.theta, cfg.rope_local.theta) == ("linear", 4.0, 1e6, 1e4)


def test_prompt_logits_match_transformers(pair) -> None:
    name, model_dir, hf_model, runner = pair
    prompt = _prompt(45, seed=1)
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0].float()
    assert rel_err(runner.prompt_logits(prompt), ref) < REL_TOL, name
    assert rel_err(runner.prompt_logits(prompt, chunk_size=4), ref) < REL_TOL, name
    # the window really matters: full attention over the same weights is far off
    with torch.no_grad():
        hf_model.config._attn_implementation = "eager"
        full = hf_model.model.config.sliding_window
        try:
            hf_model.config.sliding_window = 1 << 20
            for layer in hf_model.model.layers:
                if getattr(layer.self_attn, "sliding_window", None):
                    layer.self_attn.sliding_window = 1 << 20
            unwindowed = hf_model(torch.tensor([prompt])).logits[0].float()
        finally:
            hf_model.config.sliding_window = full
            for layer in hf_model.model.layers:
                if getattr(layer.self_attn, "sliding_window", None):
                    layer.self_attn.sliding_window = full
    assert rel_err(unwindowed, ref) > 100 * REL_TOL, name
    reference = make_runner(model_dir, num_blocks=64, backend=TorchRefAttention())
    assert rel_err(reference.prompt_logits(prompt, chunk_size=5), ref) < REL_TOL, name


def test_greedy_alone_and_in_a_batch_of_8(pair) -> None:
    name, _, hf_model, runner = pair
    prompts = [_prompt(3 + 2 * i, seed=10 + i) for i in range(8)]
    expected = [hf_greedy(hf_model, p, NUM_NEW) for p in prompts]
    assert len(set(map(tuple, expected))) == 8, name  # the cases really differ
    assert run_greedy(runner, [prompts[-1]], NUM_NEW) == [expected[-1]], name
    assert run_greedy(runner, prompts, NUM_NEW, chunk=3, stagger=1) == expected, name


def test_engine_prefix_cache_hit_and_speculation(pair) -> None:
    from tandem import SamplingParams
    from tandem.config import CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
    from tandem.engine.core import EngineCore
    from tandem.request import Request

    name, model_dir, hf_model, _ = pair
    prompt = _prompt(37, seed=99)  # 9 full blocks of 4, then a partial one
    expected = hf_greedy(hf_model, prompt, 16)
    spec = SpeculativeConfig(method="draft", speculative_model=str(model_dir), num_speculative_tokens=3)
    config = EngineConfig(model=ModelConfig(model=str(model_dir), dtype="float32"),
                          cache=CacheConfig(block_size=4, num_blocks=64), num_threads=1, speculative=spec)
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
    stats = core.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_acceptance_rate > 0.9, name
    assert core.scheduler.kv_cache_usage == 0.0


@pytest.mark.parametrize("name", ["mistral_window"])  # NOTE: Gemma's windowed kernel rows: tests/unit
def test_bf16_greedy_does_not_depend_on_the_batch(name, checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 (the kernels' dtype): a request's greedy tokens alone == inside a staggered batch of 8, while
    its context crosses the window (Mistral: the fused C++ layer serves steps whose contexts fit in the
    window, the per-op path with the windowed kernel the others)."""
    from tandem.config import CacheConfig, EngineConfig, ModelConfig
    from tandem.models import llama
    from tandem.worker.model_runner import ModelRunner

    fused_contexts: list[int] = []  # the longest context of each fused layer call
    fused = llama.kernels.decoder_layer
    monkeypatch.setattr(llama.kernels, "decoder_layer", lambda *a: fused_contexts.append(
        int(a[10].seq_lens.max())) or fused(*a))
    model_dir = checkpoint(name)
    config = EngineConfig(model=ModelConfig(model=str(model_dir), dtype="bfloat16"),
                          cache=CacheConfig(block_size=4, num_blocks=160), num_threads=1)
    runner = ModelRunner(model_dir, config, progress=False)
    runner.initialize_kv_cache(160)
    prompts = [_prompt(3 + 2 * i, seed=10 + i) for i in range(8)]
    alone = [run_greedy(runner, [p], 24)[0] for p in prompts]
    assert len(set(map(tuple, alone))) == 8
    assert run_greedy(runner, prompts, 24, chunk=3, stagger=1) == alone, name
    if name == "mistral_window" and llama.registry.use("decoder_layer", tokens=1):
        assert fused_contexts and max(fused_contexts) <= WINDOW


def test_qwen2_sliding_layers_match_transformers(checkpoint) -> None:
    """Qwen2 with ``use_sliding_window``: layers from ``max_window_layers`` on slide (full attention in layer 0)."""
    from transformers import AutoModelForCausalLM

    from tandem.models.hf_config import load_hf_config

    model_dir = checkpoint("qwen2_window")
    assert load_hf_config(model_dir).layer_windows == (None, WINDOW, WINDOW)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = _prompt(45, seed=1)
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0].float()
    runner = make_runner(model_dir, num_blocks=64)
    assert rel_err(runner.prompt_logits(prompt), ref) < REL_TOL
    assert rel_err(runner.prompt_logits(prompt, chunk_size=4), ref) < REL_TOL
