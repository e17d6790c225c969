"""GGUF mixture-of-experts files (llama.cpp's merged ``ffn_*_exps`` tensors) -> Tandem, against transformers.

Each tiny MoE model of tests/conftest.py is written the way llama.cpp's ``convert_hf_to_gguf.py`` writes
it (merged 3-D experts, router ``ffn_gate_inp``, shared expert ``*_shexp``, q/k rows permuted for the
Llama-derived families), converted, and run by Tandem: float32 logits equal the original transformers
model's within 1e-4 relative. Q8_0 / Q4_0 expert tensors dequantize to exactly gguf-py's values.
OLMoE and Granite-MoE GGUFs are refused (transformers cannot rebuild their tokenizers).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors import safe_open

from tandem.models.gguf_convert import convert_gguf
from tests.conftest import _tiny_config
from tests.parity.test_models_vs_hf import make_runner, rel_err
from tests.unit.test_gguf_convert import (  # noqa: F401
    bpe,
    encode,
    encode_q4_k,
    encode_q6_k,
    llama_cpp_permute,
    write_tokenizer_metadata,
)

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
PERMUTED = ("mixtral",)
ATTN = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
        "q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}
DENSE = {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def hf_model(name: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _tiny_config(name)
    config.vocab_size = 320  # the test tokenizer's size
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if pname.endswith("norm.weight") else p.normal_(0.0, 0.15)
    return model


def gguf_tensors(name: str, model) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array (HF row-major shape), as llama.cpp's converter lays them out."""
    cfg, out = model.config, {}
    for hf_name, tensor in model.state_dict().items():
        data = tensor.float().numpy()
        if hf_name == "model.embed_tokens.weight":
            out["token_embd.weight"] = data
        elif hf_name == "model.norm.weight":
            out["output_norm.weight"] = data
        elif hf_name == "lm_head.weight":
            out["output.weight"] = data
        else:
            _, _, layer, *rest = hf_name.split(".")
            out.update(_block(name, cfg, int(layer), ".".join(rest), data))
    return out


def _block(name, cfg, i, rest, data) -> dict[str, np.ndarray]:
    blk = f"blk.{i}"
    module, _, suffix = rest.rpartition(".")
    leaf = module.rsplit(".", 1)[-1]
    if module in ("input_layernorm", "post_attention_layernorm"):
        return {f"{blk}.{'attn_norm' if module == 'input_layernorm' else 'ffn_norm'}.{suffix}": data}
    if module.startswith("self_attn."):
        if name in PERMUTED and leaf in ("q_proj", "k_proj"):
            data = llama_cpp_permute(data, cfg.num_attention_heads if leaf == "q_proj" else cfg.num_key_value_heads)
        return {f"{blk}.{ATTN[leaf]}.{suffix}": data}
    if rest.endswith("experts.gate_up_proj"):
        gate, up = np.split(data, 2, axis=1)
        return {f"{blk}.ffn_gate_exps.weight": gate, f"{blk}.ffn_up_exps.weight": up}
    if rest.endswith("experts.down_proj"):
        return {f"{blk}.ffn_down_exps.weight": data}
    if leaf in ("gate", "router"):
        return {f"{blk}.ffn_gate_inp.weight": data}
    if leaf == "shared_expert_gate":
        return {f"{blk}.ffn_gate_inp_shexp.weight": data}
    if ".shared_expert." in f".{module}":
        return {f"{blk}.{DENSE[leaf]}_shexp.weight": data}
    return {f"{blk}.{DENSE[leaf]}.weight": data}  # a dense layer (Qwen2-MoE's mlp_only_layers)


def write_moe_gguf(path, name: str, model, tokenizer, expert_type: Q = Q.F32,
                   kquant: dict[str, Q] | None = None) -> dict[str, np.ndarray]:
    """Write the GGUF; returns what each expert tensor holds (as llama.cpp would dequantize it). ``kquant``
    ({"gate" | "up" | "down": Q4_K or Q6_K}) writes those experts as random K-quant blocks (gguf-py cannot
    quantize to them), whose values are returned."""
    cfg, arch = model.config, GGUF_ARCH[name]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if hasattr(cfg, "moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    if name == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    write_tokenizer_metadata(w, tokenizer, "qwen2" if name.startswith("qwen") else "default")
    stored, rng = {}, np.random.default_rng(0)
    for gname, data in gguf_tensors(name, model).items():
        qtype = expert_type if "_exps" in gname else Q.F32
        proj = gname.split(".")[-2].removeprefix("ffn_").removesuffix("_exps")
        if "_exps" in gname and kquant and proj in kquant:
            encoder = encode_q4_k if kquant[proj] == Q.Q4_K else encode_q6_k
            blocks, values = encoder(rng, int(np.prod(data.shape[:-1])), data.shape[-1])
            w.add_tensor(gname, blocks.reshape(*data.shape[:-1], -1), raw_dtype=kquant[proj])
            stored[gname] = values.reshape(data.shape)
            continue
        array, raw = encode(data, qtype)
        w.add_tensor(gname, array, raw_dtype=raw)
        if "_exps" in gname:
            stored[gname] = gguf.quants.dequantize(array, qtype).reshape(data.shape) if raw else data
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def stored_logits(model, stored: dict[str, np.ndarray], prompt: list[int]) -> torch.Tensor:
    """The reference: float32 logits of ``model`` with its experts replaced by the file's values (``stored``)."""
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            gate, up, down = (torch.from_numpy(stored[f"blk.{i}.ffn_{p}_exps.weight"]) for p in ("gate", "up", "down"))
            layer.mlp.experts.gate_up_proj.copy_(torch.cat([gate, up], dim=1))
            layer.mlp.experts.down_proj.copy_(down)
        return model(torch.tensor([prompt])).logits[0]


@pytest.mark.parametrize("name", list(GGUF_ARCH))
def test_moe_gguf_round_trip_matches_transformers(tmp_path, bpe, name):  # noqa: F811
    model = hf_model(name)
    write_moe_gguf(tmp_path / "m.gguf", name, model, bpe)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "hf", progress=False)
    prompt = torch.randint(3, 320, (23,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0]
    ours = make_runner(out).prompt_logits(prompt)
    assert rel_err(ours, ref) < 1e-4, name


@pytest.mark.parametrize(("qtype", "fmt"), [(Q.Q8_0, "q8_0"), (Q.Q4_0, "int4")])
def test_q8_0_and_q4_0_experts_keep_their_codes(tmp_path, bpe, qtype, fmt):  # noqa: F811
    """Q8_0 / Q4_0 merged experts stay codes (``QuantizedExperts``, run by kernels.moe_q8_0 / moe_int4 in bf16)
    that dequantize to exactly gguf-py's values; float32 logits match the model holding those values."""
    from tandem.models.moe_quant import QuantizedExperts
    from tandem.models.quant import dequantize_weight

    name = "qwen3_moe"
    model = hf_model(name)
    stored = write_moe_gguf(tmp_path / "m.gguf", name, model, bpe, expert_type=qtype)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "hf", progress=False)
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "model.layers.0.mlp.experts.gate_proj" not in f.keys()
        for proj in ("gate", "up", "down"):
            codes, scales = (f.get_tensor(f"model.layers.0.mlp.experts.{proj}_proj.{p}") for p in ("qweight", "scale"))
            got = np.stack([dequantize_weight(fmt, c, s).numpy() for c, s in zip(codes, scales, strict=True)])
            assert np.array_equal(got, stored[f"blk.0.ffn_{proj}_exps.weight"]), proj
    prompt = list(range(3, 20))
    ref = stored_logits(model, stored, prompt)
    runner = make_runner(out)
    assert [m.method for m in runner.model.modules() if isinstance(m, QuantizedExperts)] == [fmt] * 2
    assert rel_err(runner.prompt_logits(prompt), ref) < 1e-4
    bf16 = make_runner(out, dtype="bfloat16")  # the fused kernel on the file's codes
    plain = make_runner(convert_gguf(tmp_path / "m.gguf", tmp_path / "hf-f32", progress=False, keep_quantized=False),
                        dtype="bfloat16")  # the same values as bf16 experts (kernels.moe_bf16)
    ours, theirs = bf16.prompt_logits(prompt), plain.prompt_logits(prompt)
    # NOTE: bf16 itself is 1-6% off float32 here (Q4_0's values are not bf16 numbers); the int8 activations of
    # the quantized kernel add about 1% on top
    assert rel_err(ours, theirs) < 2**-5 and rel_err(ours, ref) < 0.1


def test_q4_k_and_q6_k_experts_keep_their_codes(tmp_path, bpe):  # noqa: F811
    """llama.cpp's Q4_K_M expert mix (gate / up Q4_K, down Q6_K) stays codes (``QuantizedExperts`` q4_k / q6_k,
    run by kernels.moe_kquant in bf16); float32 logits match the model holding gguf-py's values of the blocks."""
    from transformers import AutoModelForCausalLM

    from tandem.models.moe_quant import QuantizedExperts

    config = _tiny_config("qwen3_moe")
    config.vocab_size, config.hidden_size, config.moe_intermediate_size = 320, 256, 256  # K-quants: multiples of 256
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if pname.endswith("norm.weight") else p.normal_(0.0, 0.05)
    kinds = {"gate": Q.Q4_K, "up": Q.Q4_K, "down": Q.Q6_K}
    stored = write_moe_gguf(tmp_path / "m.gguf", "qwen3_moe", model, bpe, kquant=kinds)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "hf", progress=False)
    prompt = list(range(3, 20))
    ref = stored_logits(model, stored, prompt)
    runner = make_runner(out)
    experts = [m for m in runner.model.modules() if isinstance(m, QuantizedExperts)]
    assert [(m.method, m.w2_method) for m in experts] == [("q4_k", "q6_k")] * 2
    assert rel_err(runner.prompt_logits(prompt), ref) < 1e-4  # float32: the dequantized codes
    bf16 = make_runner(out, dtype="bfloat16")  # kernels.moe_kquant on the file's codes
    plain = make_runner(convert_gguf(tmp_path / "m.gguf", tmp_path / "hf-f32", progress=False, keep_quantized=False),
                        dtype="bfloat16")
    assert rel_err(bf16.prompt_logits(prompt), plain.prompt_logits(prompt)) < 2**-4


def test_olmoe_gguf_is_refused_by_name(tmp_path, bpe):  # noqa: F811
    from tandem.models.gguf_convert import UnsupportedGGUFError

    w = gguf.GGUFWriter(str(tmp_path / "o.gguf"), "olmoe")
    write_tokenizer_metadata(w, bpe, "default")
    w.add_tensor("token_embd.weight", np.zeros((320, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedGGUFError, match="'olmoe' is not supported; supported: llama, qwen2, qwen3, gemma2, "
                       "gemma3, phi3, qwen2m"):
        convert_gguf(tmp_path / "o.gguf", tmp_path / "hf", progress=False)
