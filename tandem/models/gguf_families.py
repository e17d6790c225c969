"""GGUF files of the Gemma 2, Gemma 3 (text) and Phi-3 families: config keys and tensor names (used by
``gguf_convert``).

What llama.cpp's converter and loader do, undone here:
- Gemma 2 / 3 store every RMSNorm weight as ``1 + w`` (Gemma's norm scales by ``1 + w``; llama.cpp's by
  ``w``), so ``norm_shift`` subtracts 1 again (in float32). The four norms of a block are ``attn_norm``,
  ``post_attention_norm``, ``ffn_norm`` (HF ``pre_feedforward_layernorm``) and ``post_ffw_norm``.
- Which Gemma layers slide is not in the file: llama.cpp's loader fixes it (Gemma 2: layers 0, 2, 4, ...;
  Gemma 3: five of every six, the sixth global), as is Gemma 3's local rope (base 10000, unscaled; a
  ``rope.freq_base_swa`` key wins when present) and the attention scale (``1 / sqrt(hidden / heads)`` for
  the 27B models, 46 / 62 layers, which is their ``query_pre_attn_scalar``; ``1 / sqrt(head_dim)`` for
  the others).
- Phi-3 keeps q/k/v fused as ``attn_qkv`` and gate/up as ``ffn_up`` (gate rows first), exactly Tandem's
  ``qkv_proj`` / ``gate_up_proj``; ``rope.dimension_count`` is the rotated part of a head (Phi-4-mini:
  0.75); longrope's factors are the ``rope_factors_long`` / ``rope_factors_short`` tensors beside
  ``rope.scaling.attn_factor`` and ``rope.scaling.original_context_length``; ``sliding_window`` 0 means
  none (Phi-4).

Sources: llama.cpp ``convert_hf_to_gguf.py`` (``Gemma2Model``, ``Gemma3Model``, ``Phi3MiniModel``) and
``src/llama-model.cpp`` (``LLM_ARCH_GEMMA2`` / ``GEMMA3`` hparams); gguf-py ``constants.py`` for names.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# GGUF `general.architecture` -> (HF architecture class, HF model_type).
FAMILY_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
}
_GEMMA_TYPES = frozenset({"gemma2", "gemma3_text"})
# GGUF block tensor base -> HF name after "model.layers.N." where it differs from Llama's.
_BLOCK = {
    "gemma": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
# Phi-3's fused q/k/v is a linear layer like attn_q (kept as codes when its block type allows).
LINEAR_BASES = frozenset({"attn_qkv"})
ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}


def block_tensor_name(base: str, model_type: str) -> str | None:
    """The HF name (after ``model.layers.N.``, without suffix) of a family-specific block tensor ``base``,
    or None when the generic (Llama) name applies."""
    family = "gemma" if model_type in _GEMMA_TYPES else model_type
    return _BLOCK.get(family, {}).get(base)


def norm_shift(model_type: str, hf_name: str) -> float:
    """What to add to a tensor to undo the converter: -1.0 for Gemma's norm weights, else 0.0."""
    return -1.0 if model_type in _GEMMA_TYPES and hf_name.endswith("norm.weight") else 0.0


def head_dim(meta: dict[str, Any], arch: str, hidden: int, heads: int) -> int | None:
    """Phi-3's head size (hidden / heads: its ``rope.dimension_count`` is the rotated part only); None
    for the others (the generic rule applies)."""
    return hidden // heads if arch == "phi3" else None


def family_config(meta: dict[str, Any], arch: str, config: dict[str, Any],
                  rope_factors: dict[str, np.ndarray]) -> dict[str, Any]:
    """Config keys of a Gemma 2 / Gemma 3 / Phi-3 file on top of the generic ones in ``config``
    (``rope_parameters`` there is the file's global rope).

    Raises:
        KeyError: a key the family needs (e.g. ``gemma2.attention.sliding_window``) is missing.
    """
    if arch == "phi3":
        return _phi3_config(meta, config, rope_factors)
    model_type = config["model_type"]
    layers = config["num_hidden_layers"]
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    big = layers == _GEMMA_27B_LAYERS[model_type]
    out: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // heads if big else config["head_dim"],
        "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping"),
        "attention_bias": False,
    }
    key = f"{arch}.attention.sliding_window"
    window = meta[key] if arch == "gemma2" else meta.get(key)  # NOTE: llama.cpp requires it for Gemma 2 only
    out["sliding_window"] = int(window) if window else None
    if arch == "gemma2":
        out["attn_logit_softcapping"] = meta.get(f"{arch}.attn_logit_softcapping")
        sliding = [i % 2 == 0 for i in range(layers)]
    else:
        sliding = [(i + 1) % 6 != 0 for i in range(layers)] if window else [False] * layers
        local = {"rope_type": "default", "rope_theta": float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0))}
        out["rope_parameters"] = {"full_attention": config["rope_parameters"], "sliding_attention": local}
    out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    return out


def _phi3_config(meta: dict[str, Any], config: dict[str, Any], rope_factors: dict[str, np.ndarray]) -> dict:
    window = meta.get("phi3.attention.sliding_window")
    out: dict[str, Any] = {"sliding_window": int(window) if window else None}
    rotated = meta.get("phi3.rope.dimension_count")
    if rotated is not None and int(rotated) != config["head_dim"]:
        out["partial_rotary_factor"] = int(rotated) / config["head_dim"]
    original = meta.get("phi3.rope.scaling.original_context_length")
    if original is not None:
        out["original_max_position_embeddings"] = int(original)
    if rope_factors:
        rope = dict(config["rope_parameters"], rope_type="longrope",
                    long_factor=rope_factors["rope_factors_long.weight"].astype(float).tolist(),
                    short_factor=rope_factors["rope_factors_short.weight"].astype(float).tolist())
        if original is not None:
            rope["original_max_position_embeddings"] = int(original)
        if (attn_factor := meta.get("phi3.rope.scaling.attn_factor")) is not None:
            rope["attention_factor"] = float(str(np.float32(attn_factor)))
        out["rope_parameters"] = rope
    return out
