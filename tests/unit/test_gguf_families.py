"""Gemma 2, Gemma 3 (text) and Phi-3 GGUF files: converted, then run by Tandem, against transformers.

Each tiny random HF model is written to GGUF as llama.cpp's ``convert_hf_to_gguf.py`` writes that family
(gguf-py's own HF -> GGUF tensor names; Gemma's norms stored as ``1 + w``; Phi-3's fused ``attn_qkv`` /
``ffn_up``, ``rope.dimension_count`` of the rotated dims, ``rope_factors_long/short`` tensors). The HF
models follow what llama.cpp's loader assumes and the file cannot say: Gemma 2 slides on layers 0, 2, ...,
Gemma 3 on five of every six (local rope 10000), ``query_pre_attn_scalar`` = head_dim. Windows (8) and the
longrope switch (original context 32) are shorter than the 45-token prompt, so a wrong guess shows.

F32 files: Tandem's prompt logits equal the original model's within 1e-4. Q8_0 files: Tandem on the kept
codes equals transformers on the same file dequantized by gguf-py (``keep_quantized=False``).
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tandem.models.gguf_convert import QUANTIZED_KEY, convert_gguf
from tests.parity.test_models_vs_hf import make_runner, rel_err
from tests.unit.test_gguf_convert import (  # noqa: F401 (bpe is a fixture)
    bpe,
    encode,
    write_shape_metadata,
    write_tokenizer_metadata,
)

VOCAB, WINDOW, ORIGINAL = 320, 8, 32
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
               pad_token_id=0)
GEMMA3_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]


def _config(name: str):
    import transformers as tf

    if name == "gemma2":
        return tf.Gemma2Config(**_COMMON, num_hidden_layers=3, query_pre_attn_scalar=16, sliding_window=WINDOW,
                               attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    if name == "gemma3":
        return tf.Gemma3TextConfig(**_COMMON, num_hidden_layers=6, query_pre_attn_scalar=16, sliding_window=WINDOW,
                                   final_logit_softcapping=5.0, layer_types=GEMMA3_LAYERS,
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                    "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                       "rope_theta": 1e6}})
    g = torch.Generator().manual_seed(3)
    half = int(16 * 0.5) // 2  # Phi-4-mini style partial rotary: half of each head rotates
    rope = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": (1.0 + 0.5 * torch.rand(half, generator=g)).tolist(),
            "long_factor": (1.0 + 7.0 * torch.rand(half, generator=g)).tolist()}
    common = {k: v for k, v in _COMMON.items() if k != "head_dim"}
    return tf.Phi3Config(**common, num_hidden_layers=2, tie_word_embeddings=False, rope_parameters=rope,
                         original_max_position_embeddings=ORIGINAL, partial_rotary_factor=0.5)


def tiny(name: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(name), dtype=torch.float32).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):  # Gemma scales by 1 + w, Phi-3 by w
                p.copy_((0.0 if name.startswith("gemma") else 1.0) + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


def _write_metadata(writer: gguf.GGUFWriter, name: str, cfg) -> None:
    """The keys llama.cpp's Gemma2Model / Gemma3Model / Phi3MiniModel write."""
    write_shape_metadata(writer, cfg)
    if name == "phi3":
        rope = cfg.rope_parameters
        writer.add_rope_scaling_orig_ctx_len(ORIGINAL)
        writer.add_rope_dimension_count(int(0.5 * cfg.hidden_size) // cfg.num_attention_heads)
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_sliding_window(0)
        scale = cfg.max_position_embeddings / ORIGINAL
        writer.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(ORIGINAL))))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
        return
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_sliding_window(WINDOW)
    writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if name == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    else:
        writer.add_rope_freq_base(1e6)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(4.0)


def write_family_gguf(path, model, bpe_tok, name: str, matrix_type: Q = Q.F32) -> None:
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), name)
    _write_metadata(writer, name, cfg)
    write_tokenizer_metadata(writer, bpe_tok, "default")
    writer.add_pad_token_id(0)  # NOTE: else transformers' Phi3Config defaults pad to 32000, past this vocab
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[name.upper()], cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        data = tensor.float().numpy()
        if name.startswith("gemma") and hf_name.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp's Gemma converters: the file holds 1 + w
        array, raw = encode(data, matrix_type if data.ndim == 2 else Q.F32)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", array, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


PROMPT = [int(t) for t in torch.randint(3, VOCAB, (45,), generator=torch.Generator().manual_seed(5))]


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3"])
def test_f32_file_runs_like_the_original_model(tmp_path, bpe, name):  # noqa: F811
    model = tiny(name)
    write_family_gguf(tmp_path / "m.gguf", model, bpe, name)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "hf", progress=False)
    config = json.loads((out / "config.json").read_text())
    if name == "gemma3":
        assert config["layer_types"] == GEMMA3_LAYERS and config["model_type"] == "gemma3_text"
        assert config["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    if name == "phi3":
        assert config["partial_rotary_factor"] == 0.5 and config["rope_parameters"]["rope_type"] == "longrope"
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0]
    runner = make_runner(out, num_blocks=64)
    assert rel_err(runner.prompt_logits(PROMPT), ref) < 1e-4
    assert rel_err(runner.prompt_logits(PROMPT, chunk_size=4), ref) < 1e-4


def test_the_file_facts_matter(tmp_path, bpe):  # noqa: F811
    """Guards the comparison: without the norm shift, or with every Gemma 3 layer global, logits differ."""
    model = tiny("gemma3")
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0]
        model.config.layer_types = ["full_attention"] * 6
        for layer in model.model.layers:
            layer.attention_type = "full_attention"
            layer.self_attn.sliding_window = None
        assert rel_err(model(torch.tensor([PROMPT])).logits[0], ref) > 1e-2
    unshifted = tiny("gemma3")
    with torch.no_grad():
        for pname, p in unshifted.named_parameters():
            if pname.endswith("norm.weight"):
                p.add_(1.0)
        assert rel_err(unshifted(torch.tensor([PROMPT])).logits[0], ref) > 1e-2


@pytest.mark.parametrize("name", ["gemma2", "phi3"])
def test_q8_0_file_keeps_codes_and_matches_transformers_on_the_dequantized_file(tmp_path, bpe, name):  # noqa: F811
    from transformers import AutoModelForCausalLM

    model = tiny(name)
    write_family_gguf(tmp_path / "m.gguf", model, bpe, name, matrix_type=Q.Q8_0)
    kept = convert_gguf(tmp_path / "m.gguf", tmp_path / "kept", progress=False)
    plain = convert_gguf(tmp_path / "m.gguf", tmp_path / "plain", progress=False, keep_quantized=False)
    modules = json.loads((kept / "config.json").read_text())[QUANTIZED_KEY]["modules"]
    fused = "model.layers.0.self_attn.qkv_proj" if name == "phi3" else "model.layers.0.self_attn.q_proj"
    assert modules[fused] == "q8_0"
    reference = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = reference(torch.tensor([PROMPT])).logits[0]
        original = model(torch.tensor([PROMPT])).logits[0]
    assert rel_err(ref, original) > 1e-5  # the file really is quantized
    assert rel_err(make_runner(kept, num_blocks=64).prompt_logits(PROMPT), ref) < 1e-4
