"""Config parsing and weight loading: formats, fusion, tying, and a clear error for each broken checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tandem.config import ConfigError
from tandem.models.hf_config import CheckpointError, load_hf_config
from tandem.models.loader import load_model
from tandem.worker.model_runner import resolve_context_len

BASE_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 128,
    "max_position_embeddings": 256,
}


def write_config(tmp_path: Path, gen: dict | None = None, **changes) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({**BASE_CONFIG, **changes}))
    if gen is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    return tmp_path


@pytest.fixture
def llama_copy(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    """A writable copy of the tiny untied Llama checkpoint."""
    return Path(shutil.copytree(tiny_llama_dir, tmp_path / "llama"))


# ---- config.json / generation_config.json ----

def test_config_transformers5_rope_parameters_and_defaults(tmp_path: Path) -> None:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    gen = {"eos_token_id": [2, 7], "bos_token_id": 1, "temperature": 0.6, "top_p": 0.9, "do_sample": True}
    cfg = load_hf_config(write_config(tmp_path, gen, rope_parameters=rope, eos_token_id=2))
    assert cfg.rope.rope_type == "llama3" and cfg.rope.theta == 500000.0 and cfg.rope.factor == 8.0
    assert cfg.rope.original_max_position_embeddings == 8192
    assert cfg.eos_token_ids == (2, 7) and cfg.bos_token_id == 1
    assert cfg.generation_defaults == {"temperature": 0.6, "top_p": 0.9}
    assert cfg.head_dim == 16 and cfg.num_kv_heads == 2 and not cfg.tie_word_embeddings


def test_config_legacy_rope_theta_and_scaling(tmp_path: Path) -> None:
    scaling = {"type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    cfg = load_hf_config(write_config(tmp_path, rope_theta=1e6, rope_scaling=scaling, eos_token_id=[5, 6]))
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.factor) == ("llama3", 1e6, 2.0)
    assert cfg.eos_token_ids == (5, 6) and cfg.generation_defaults == {}
    plain = load_hf_config(write_config(tmp_path, rope_theta=1e5, rope_scaling=None))
    assert (plain.rope.rope_type, plain.rope.theta) == ("default", 1e5)


def test_config_unsupported_rope_type(tmp_path: Path) -> None:
    write_config(tmp_path, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(CheckpointError, match="rope type 'yarn' is not supported.*default, linear, llama3"):
        load_hf_config(tmp_path)


def test_config_qwen2_bias_and_sliding_window(tmp_path: Path) -> None:
    qwen2 = load_hf_config(write_config(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=32,
                                        use_sliding_window=False))
    assert qwen2.attention_bias and qwen2.sliding_window is None and qwen2.max_model_len == 256
    mistral = load_hf_config(write_config(tmp_path, architectures=["MistralForCausalLM"], sliding_window=64))
    # the window is attended over the paged cache: no longer a context limit
    assert mistral.sliding_window == 64 and mistral.max_model_len == 256
    assert mistral.layer_windows == (64, 64) and mistral.layer_window(1) == 64
    assert resolve_context_len(None, mistral) == 256 and resolve_context_len(128, mistral) == 128
    qwen2_sliding = load_hf_config(write_config(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=32,
                                                use_sliding_window=True, max_window_layers=1))
    assert qwen2_sliding.layer_windows == (None, 32)
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings 256"):
        resolve_context_len(512, qwen2)


def test_missing_config_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config\.json in"):
        load_hf_config(tmp_path)


def test_unknown_architecture_names_supported_ones(tmp_path: Path) -> None:
    write_config(tmp_path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel.*not supported.*LlamaForCausalLM, "
                                              "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        load_hf_config(tmp_path)


def test_missing_config_field(tmp_path: Path) -> None:
    config = dict(BASE_CONFIG)
    del config["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="missing required field 'intermediate_size'"):
        load_hf_config(tmp_path)


# ---- weights ----

def test_fused_projections_and_dtype(tiny_llama_dir: Path) -> None:
    cfg = load_hf_config(tiny_llama_dir)
    model = load_model(tiny_llama_dir, cfg, "bfloat16", progress=False)
    ref = load_file(str(tiny_llama_dir / "model.safetensors"))
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    p = "model.layers.1."
    qkv = torch.cat([ref[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
    assert attn.qkv_proj.weight.dtype == torch.bfloat16
    assert torch.equal(attn.qkv_proj.weight, qkv.to(torch.bfloat16))
    gate_up = torch.cat([ref[p + "mlp.gate_proj.weight"], ref[p + "mlp.up_proj.weight"]])
    assert torch.equal(mlp.gate_up_proj.weight, gate_up.to(torch.bfloat16))
    assert torch.equal(model.lm_head.weight, ref["lm_head.weight"].to(torch.bfloat16))
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_tied_embeddings_when_lm_head_absent(tiny_checkpoint_factory) -> None:
    model_dir = tiny_checkpoint_factory("qwen2")
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    model = load_model(model_dir, load_hf_config(model_dir), "float32", progress=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_sharded_checkpoint_loads_every_shard(tiny_checkpoint_factory) -> None:
    model_dir = tiny_checkpoint_factory("qwen3")
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = load_model(model_dir, load_hf_config(model_dir), "float32", progress=False)
    name = "model.layers.1.self_attn.k_norm.weight"
    with safe_open(str(model_dir / index["weight_map"][name]), "pt") as f:
        assert torch.equal(model.model.layers[1].self_attn.k_norm.weight, f.get_tensor(name))


def test_no_weights(llama_copy: Path) -> None:
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no weights in .*expected model\.safetensors"):
        load_model(llama_copy, load_hf_config(llama_copy), progress=False)


def test_missing_shard(tiny_checkpoint_factory, tmp_path: Path) -> None:
    model_dir = Path(shutil.copytree(tiny_checkpoint_factory("qwen3"), tmp_path / "qwen3"))
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (model_dir / shard).unlink()
    with pytest.raises(FileNotFoundError, match=f"shard {shard} listed in"):
        load_model(model_dir, load_hf_config(model_dir), progress=False)


def test_truncated_file(llama_copy: Path) -> None:
    path = llama_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read safetensors file.*truncated"):
        load_model(llama_copy, load_hf_config(llama_copy), progress=False)


def test_missing_tensor(llama_copy: Path) -> None:
    path = llama_copy / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model\.layers\.1\.self_attn\.k_proj\."):
        load_model(llama_copy, load_hf_config(llama_copy), progress=False)


def test_wrong_shape(llama_copy: Path) -> None:
    path = llama_copy / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.norm.weight"] = torch.ones(63)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"tensor model\.norm\.weight in model\.safetensors has shape "
                                              r"\[63\], expected \[64\]"):
        load_model(llama_copy, load_hf_config(llama_copy), progress=False)


def test_untied_checkpoint_without_lm_head(llama_copy: Path) -> None:
    path = llama_copy / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["lm_head.weight"]
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) lm_head\.weight"):
        load_model(llama_copy, load_hf_config(llama_copy), progress=False)


def test_config_gemma_layer_patterns_ropes_and_caps_in_the_older_layout(tmp_path: Path) -> None:
    """Files without ``layer_types`` / ``rope_parameters`` (transformers < 4.54): each family's own rule."""
    gemma2 = load_hf_config(write_config(tmp_path, architectures=["Gemma2ForCausalLM"], num_hidden_layers=3,
                                         sliding_window=16, hidden_activation="gelu_pytorch_tanh",
                                         query_pre_attn_scalar=144, attn_logit_softcapping=50.0,
                                         final_logit_softcapping=30.0))
    assert gemma2.layer_windows == (16, None, 16) and gemma2.hidden_act == "gelu_tanh"
    assert gemma2.attention_multiplier == 144**-0.5 and gemma2.tie_word_embeddings
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping, gemma2.rope_local) == (50.0, 30.0, None)
    gemma3 = load_hf_config(write_config(tmp_path, architectures=["Gemma3ForCausalLM"], num_hidden_layers=7,
                                         sliding_window=16, sliding_window_pattern=3, rope_theta=1e6,
                                         rope_local_base_freq=1e4, attn_logit_softcapping=50.0,
                                         rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert gemma3.layer_windows == (16, 16, None, 16, 16, None, 16)
    assert (gemma3.rope.rope_type, gemma3.rope.theta, gemma3.rope.factor) == ("linear", 1e6, 8.0)
    assert (gemma3.rope_local.rope_type, gemma3.rope_local.theta) == ("default", 1e4)
    assert gemma3.attn_logit_softcapping is None  # transformers' Gemma3 attention does not apply it
    with pytest.raises(CheckpointError, match="hidden_act 'relu' is not supported for this architecture"):
        load_hf_config(write_config(tmp_path, hidden_act="relu"))
    with pytest.raises(CheckpointError, match="hidden_act 'gelu_pytorch_tanh' is not supported.*only 'silu'"):
        load_hf_config(write_config(tmp_path, hidden_act="gelu_pytorch_tanh"))  # a Llama with Gemma's MLP
    with pytest.raises(CheckpointError, match="use_bidirectional_attention is not supported"):
        load_hf_config(write_config(tmp_path, architectures=["Gemma3ForCausalLM"], use_bidirectional_attention=True))
