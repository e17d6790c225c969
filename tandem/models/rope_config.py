"""Rotary position embedding settings read from a Hugging Face ``config.json``.

Both layouts are accepted: transformers >= 5 writes ``rope_parameters: {"rope_type", "rope_theta", ...}``
(per layer type for Gemma 3); older files write ``rope_theta`` plus an optional ``rope_scaling`` dict
(whose type key is ``rope_type`` or ``type``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tandem.models.config_errors import CheckpointError

# NOTE: "su" is longrope's old name in Phi-3 configs (transformers renames it on load).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "su")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters.

    ``rope_type`` "default" uses ``theta`` only; "linear" divides every frequency by ``factor``
    (position interpolation, Chen et al. 2023); "llama3" (Llama 3.1 frequency-dependent scaling)
    also uses ``factor``, ``low_freq_factor``, ``high_freq_factor`` and
    ``original_max_position_embeddings`` (tokens). "longrope" (LongRoPE, Ding et al. 2024; Phi-3) divides
    each frequency by ``short_factor[i]`` or ``long_factor[i]`` (``head_dim // 2`` each; which one a token
    uses: ``layers.RotaryEmbedding``) and scales cos/sin by ``attention_factor``.
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    partial_rotary_factor: float = 1.0  # the first int(head_dim * it) dims of each head rotate (Phi-4-mini: 0.75)


def rope_config(cfg: dict[str, Any], path: Path, layer_type: str) -> RopeConfig:
    """Both layouts: ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (older).

    Gemma3 has one rope per ``layer_type`` ("full_attention", "sliding_attention"): transformers 5
    nests them in ``rope_parameters``; older files give the sliding layers' ``rope_local_base_freq``
    (default rope) and the global layers' ``rope_theta`` + ``rope_scaling``.
    """
    params = dict(cfg.get("rope_parameters") or {})
    if "full_attention" in params or "sliding_attention" in params:
        params = dict(params.get(layer_type) or {})
    elif layer_type == "sliding_attention":
        params = {"rope_theta": float(cfg.get("rope_local_base_freq", 10000.0))}
    scaling = {} if layer_type == "sliding_attention" else cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{path}: rope type {rope_type!r} is not supported; supported rope types: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
    if not 0.0 < partial <= 1.0:
        raise CheckpointError(f"{path}: partial_rotary_factor must be in (0, 1], got {partial}")
    return replace(_rope_of_type(cfg, params, rope_type, float(theta), partial, path), partial_rotary_factor=partial)


def _rope_of_type(cfg: dict[str, Any], params: dict[str, Any], rope_type: str, theta: float, partial: float,
                  path: Path) -> RopeConfig:
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    if rope_type == "linear":
        if "factor" not in params:
            raise CheckpointError(f"{path}: linear rope parameters lack 'factor'")
        return RopeConfig(rope_type="linear", theta=float(theta), factor=float(params["factor"]))
    try:
        if rope_type in ("longrope", "su"):
            return _longrope_config(cfg, params, float(theta), partial, path)
        return RopeConfig(
            rope_type=rope_type,
            theta=float(theta),
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise CheckpointError(f"{path}: {rope_type} rope parameters lack {e.args[0]!r}") from None


def _longrope_config(cfg: dict[str, Any], params: dict[str, Any], theta: float, partial: float,
                     path: Path) -> RopeConfig:
    """LongRoPE as transformers' ``_compute_longrope_parameters`` reads it: the top-level
    ``original_max_position_embeddings`` wins over the rope dict's (Phi-3 writes it there), ``factor``
    defaults to ``max_position_embeddings / original``, and ``attention_factor`` to
    ``sqrt(1 + ln(factor) / ln(original))`` (1 when ``factor <= 1``)."""
    original = int(cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                   or cfg.get("max_position_embeddings", 2048))
    factor = params.get("factor")
    factor = float(factor) if factor is not None else int(cfg.get("max_position_embeddings", 2048)) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    half = int(int(cfg.get("head_dim") or hidden // heads) * partial) // 2
    short, long = tuple(map(float, params["short_factor"])), tuple(map(float, params["long_factor"]))
    if len(short) != half or len(long) != half:
        raise CheckpointError(f"{path}: longrope short_factor / long_factor need {half} values each, "
                              f"got {len(short)} / {len(long)}")
    return RopeConfig(rope_type="longrope", theta=theta, factor=factor,
                      original_max_position_embeddings=original, short_factor=short, long_factor=long,
                      attention_factor=float(attention_factor))
