"""GGUF mixture-of-experts files: config keys and tensor names (used by ``gguf_convert``).

llama.cpp stores each layer's experts merged into 3-D tensors, ``blk.N.ffn_{gate,up,down}_exps``
(HF shapes ``[E, I, H]``, ``[E, I, H]``, ``[E, H, I]``), the router as ``blk.N.ffn_gate_inp``
(``[E, H]``), and Qwen2-MoE's shared expert as ``ffn_{gate,up,down}_shexp`` with its gate
``ffn_gate_inp_shexp``. They become ``<block>.experts.{gate,up,down}_proj`` (``models/moe.py`` loads
that layout), ``<block>.gate.weight`` and
``mlp.shared_expert.*`` / ``mlp.shared_expert_gate.weight``. A layer whose three merged expert tensors are
all Q8_0 or all Q4_0 keeps their codes (``<block>.experts.{gate,up,down}_proj.qweight`` / ``.scale``, run by
``kernels.moe_q8_0`` / ``moe_int4``), and so does one whose gate and up are both Q4_K or both Q6_K and whose
down is either (llama.cpp's Q4_K_M mixes, ``kernels.moe_kquant``); other block types and mixes are dequantized
by the converter.

Sources: llama.cpp's ``convert_hf_to_gguf.py`` (``Qwen2MoeModel``, ``Qwen3MoeModel``, Mixtral through
``LlamaModel``) and gguf-py's ``constants.py`` (key and tensor
names); which of them permute q/k rows follows which converter classes derive from ``LlamaModel``.
"""

from __future__ import annotations

from typing import Any

# GGUF architecture -> (HF architecture, HF model_type, norm_topk_prob when the file does not say).
# NOTE: OLMoE and Granite-MoE GGUFs are not converted: transformers (which rebuilds the tokenizer from
# the GGUF metadata) refuses their architectures. Their HF checkpoints load.
MOE_ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe", True),
}
MIXTRAL = ("MixtralForCausalLM", "mixtral", True)  # GGUF "llama" with an expert count
# HF model types whose converter permutes q/k rows (llama.cpp's LlamaModel and its subclasses).
PERMUTED_QK = frozenset({"llama", "mixtral"})

# GGUF block tensor base -> HF name after "model.layers.N." ({moe} is the block's checkpoint name).
_BLOCK = {
    "ffn_gate_inp": "{moe}.{router}.weight",
    "ffn_gate_exps": "{moe}.experts.gate_proj",
    "ffn_up_exps": "{moe}.experts.up_proj",
    "ffn_down_exps": "{moe}.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp": "mlp.shared_expert.down_proj.weight",
}
# Shared-expert tensors are ordinary linear layers (kept quantized like any other).
SHARED_LINEAR_BASES = frozenset({"ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"})
EXPERT_BASES = frozenset({"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"})


def moe_architecture(arch: str, meta: dict[str, Any]) -> tuple[str, str, bool] | None:
    """``(HF architecture, model_type, default norm_topk_prob)`` of a MoE GGUF file, None for dense ones."""
    if arch in MOE_ARCHITECTURES:
        return MOE_ARCHITECTURES[arch]
    if arch == "llama" and int(meta.get("llama.expert_count", 0) or 0) > 0:
        return MIXTRAL
    return None


def block_tensor_name(base: str, model_type: str) -> str | None:
    """The HF name (after ``model.layers.N.``, without the ``.weight`` suffix rule) of a MoE tensor
    ``base``, or None when ``base`` is not a MoE tensor."""
    if base not in _BLOCK:
        return None
    moe = "block_sparse_moe" if model_type == "mixtral" else "mlp"
    return _BLOCK[base].format(moe=moe, router="gate")


def moe_config(
    meta: dict[str, Any], arch: str, model_type: str, default_norm: bool, shapes: dict[str, tuple[int, ...]]
) -> dict[str, Any]:
    """HF config.json entries of a MoE GGUF file (expert counts and sizes, family extras).

    ``shapes`` (GGUF tensor name -> shape) tells which layers are dense: those without a router.

    Raises:
        KeyError: a required expert key is missing (the caller turns it into UnsupportedGGUFError).
    """
    experts = int(meta[f"{arch}.expert_count"])
    config: dict[str, Any] = {"num_experts_per_tok": int(meta[f"{arch}.expert_used_count"])}
    norm = bool(meta.get(f"{arch}.expert_weights_norm", default_norm))
    expert_ffn = meta.get(f"{arch}.expert_feed_forward_length")
    if model_type in ("qwen2_moe", "qwen3_moe"):
        layers = int(meta[f"{arch}.block_count"])
        dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in shapes]
        config.update(num_experts=experts, norm_topk_prob=norm, moe_intermediate_size=int(expert_ffn),
                      decoder_sparse_step=1, mlp_only_layers=dense)
        if model_type == "qwen2_moe":
            config["shared_expert_intermediate_size"] = int(meta[f"{arch}.expert_shared_feed_forward_length"])
            config["use_sliding_window"] = False
    else:  # mixtral
        config["num_local_experts"] = experts
        if expert_ffn is not None:
            config["intermediate_size"] = int(expert_ffn)
    return config
