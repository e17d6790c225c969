"""GGUF metadata -> Hugging Face ``config.json`` (used by ``gguf_convert``).

Which architectures convert, the config keys each needs, rope scaling (including llama3's
``rope_freqs`` tensor) and the special token ids. Family-specific keys: ``gguf_moe`` (mixture of
experts), ``gguf_families`` (Gemma 2 / 3, Phi-3).

Sources: the GGUF spec (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) and llama.cpp's
``convert_hf_to_gguf.py`` (which keys it writes for each HF config field).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from gguf import GGUFReader

from tandem.models import gguf_families, gguf_moe

# GGUF `general.architecture` -> (HF architecture class, HF model_type). Mistral GGUFs use "llama".
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    **gguf_families.FAMILY_ARCHITECTURES,
}

# Tokenizer arrays are large (one entry per token); the config needs none of them.
_TOKENIZER_ARRAYS = frozenset(
    f"tokenizer.ggml.{key}" for key in ("tokens", "merges", "scores", "token_type", "precompiled_charsmap")
)


class UnsupportedGGUFError(ValueError):
    """The GGUF file uses an architecture, tensor, rope scaling or block type Tandem does not convert."""


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All GGUF key/values except the per-token tokenizer arrays, as Python values."""
    return {key: field.contents() for key, field in reader.fields.items() if key not in _TOKENIZER_ARRAYS}


def check_architecture(metadata: dict[str, Any]) -> str:
    """Return `general.architecture` if supported.

    Raises:
        UnsupportedGGUFError: any other architecture; the message names the supported ones.
    """
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES and arch not in gguf_moe.MOE_ARCHITECTURES:
        raise UnsupportedGGUFError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join([*SUPPORTED_ARCHITECTURES, *gguf_moe.MOE_ARCHITECTURES])} "
            "(Mistral and Mixtral GGUFs use 'llama')"
        )
    return arch


def _required(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise UnsupportedGGUFError(f"GGUF metadata lacks the required key {key!r}")
    return meta[key]


def _f32(value: float) -> float:
    # NOTE: GGUF stores floats as float32 (1e-5 reads back as 9.99999974e-06); the shortest decimal that
    # round-trips through float32 is the value the original config.json held.
    return float(str(np.float32(value)))


def llama3_rope_factors(
    theta: float,
    head_dim: int,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    old_context: int,
) -> np.ndarray:
    """Per-frequency divisors of llama3 rope scaling, shape (head_dim // 2,), as llama.cpp writes them.

    Source: llama.cpp `LlamaModel.generate_extra_tensors` (the same formula as transformers'
    `_compute_llama3_parameters`).
    """
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    wavelen = 2 * math.pi / freqs
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mid = 1 / ((1 - smooth) / factor + smooth)
    low_band = np.where(wavelen > old_context / low_freq_factor, factor, mid)
    return np.where(wavelen < old_context / high_freq_factor, 1.0, low_band).astype(np.float32)


def _rope_parameters(meta: dict[str, Any], arch: str, head_dim: int, rope_freqs: np.ndarray | None) -> dict:
    """HF `rope_parameters` from GGUF rope keys, or from the llama3 `rope_freqs` tensor when present.

    Raises:
        UnsupportedGGUFError: an unknown `rope.scaling.type`, or `rope_freqs` that llama3 scaling cannot
            explain.
    """
    theta = _f32(meta.get(f"{arch}.rope.freq_base", 10000.0))
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if rope_freqs is not None:
        # NOTE: llama.cpp keeps only the divisors; low/high_freq_factor 1/4 and the 8192 original context are
        # its defaults (every Llama 3.x uses them). Recomputing the tensor proves the guess right.
        llama3 = {
            "factor": float(rope_freqs.max()),
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        expected = llama3_rope_factors(theta, head_dim, *llama3.values())
        if expected.shape != rope_freqs.shape or not np.allclose(expected, rope_freqs, rtol=1e-4):
            raise UnsupportedGGUFError("GGUF rope_freqs tensor does not match llama3 rope scaling")
        params.update(rope_type="llama3", **llama3)
    elif scaling in ("linear", "yarn"):
        params.update(rope_type=scaling, factor=_f32(_required(meta, f"{arch}.rope.scaling.factor")))
        if scaling == "yarn":
            original = _required(meta, f"{arch}.rope.scaling.original_context_length")
            params["original_max_position_embeddings"] = int(original)
    elif scaling != "none":
        raise UnsupportedGGUFError(
            f"GGUF rope scaling {scaling!r} is not supported (none, linear, yarn, llama3)"
        )
    return params


def special_token_ids(meta: dict[str, Any]) -> dict[str, Any]:
    """bos/eos/pad ids from tokenizer metadata; eos becomes a list when eot/eom ids differ from it."""
    ids: dict[str, Any] = {}
    if (bos := meta.get("tokenizer.ggml.bos_token_id")) is not None:
        ids["bos_token_id"] = int(bos)
    eos = [
        int(meta[f"tokenizer.ggml.{k}_token_id"])
        for k in ("eos", "eot", "eom")
        if f"tokenizer.ggml.{k}_token_id" in meta
    ]
    eos = list(dict.fromkeys(eos))
    if eos:
        ids["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if (pad := meta.get("tokenizer.ggml.padding_token_id")) is not None:
        ids["pad_token_id"] = int(pad)
    return ids


def build_hf_config(
    meta: dict[str, Any], shapes: dict[str, tuple[int, ...]], rope_freqs: np.ndarray | None = None,
    rope_factors: dict[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """HF `config.json` contents from GGUF metadata and the HF shapes of the tensors (keyed by GGUF name).

    `rope_factors`: Phi-3's `rope_factors_long/short.weight` tensors, when the file has them.

    `torch_dtype` is left to the caller, which knows how tensors are stored.

    Raises:
        UnsupportedGGUFError: unsupported architecture or rope scaling, or a required metadata key (e.g.
            `llama.embedding_length`) is missing.
    """
    arch = check_architecture(meta)
    moe = gguf_moe.moe_architecture(arch, meta)
    hf_arch, model_type = moe[:2] if moe else SUPPORTED_ARCHITECTURES[arch]
    hidden = int(_required(meta, f"{arch}.embedding_length"))
    heads = int(_required(meta, f"{arch}.attention.head_count"))
    head_dim = gguf_families.head_dim(meta, arch, hidden, heads) or int(
        meta.get(f"{arch}.attention.key_length", meta.get(f"{arch}.rope.dimension_count", hidden // heads))
    )
    rope = _rope_parameters(meta, arch, head_dim, rope_freqs)
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(meta.get(f"{arch}.feed_forward_length") or _required(
            meta, f"{arch}.expert_feed_forward_length" if moe else f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_required(meta, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(_required(meta, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": rope["rope_theta"],
        "rope_parameters": rope,
        "max_position_embeddings": int(_required(meta, f"{arch}.context_length")),
        # NOTE: the embedding's row count is authoritative; `{arch}.vocab_size` is absent from older files.
        "vocab_size": shapes["token_embd.weight"][0],
        "tie_word_embeddings": "output.weight" not in shapes,
        **special_token_ids(meta),
    }
    if model_type == "qwen2":
        config["use_sliding_window"] = False
    else:
        config["attention_bias"] = "blk.0.attn_q.bias" in shapes
    if model_type == "llama":
        config["mlp_bias"] = "blk.0.ffn_up.bias" in shapes
    try:
        if moe:
            config.update(gguf_moe.moe_config(meta, arch, model_type, moe[2], shapes))
        if arch in gguf_families.FAMILY_ARCHITECTURES:
            config.update(gguf_families.family_config(meta, arch, config, rope_factors or {}))
    except KeyError as e:
        raise UnsupportedGGUFError(f"GGUF metadata lacks the required key {e.args[0]!r}") from None
    return config


