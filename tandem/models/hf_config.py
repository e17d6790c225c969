"""Read a Hugging Face checkpoint's ``config.json`` (+ ``generation_config.json``) into a frozen dataclass.

Only the fields the forward pass and the engine need are kept. Both rope layouts are accepted:
transformers >= 5 writes ``rope_parameters: {"rope_type", "rope_theta", ...}``; older files write
``rope_theta`` plus an optional ``rope_scaling`` dict (whose type key is ``rope_type`` or ``type``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.models.config_errors import CheckpointError
from tandem.models.rope_config import SUPPORTED_ROPE_TYPES, RopeConfig, rope_config  # noqa: F401 (re-exported)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "GraniteMoeForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# The one MLP activation each family's blocks implement (Gemma: GeGLU with tanh-approximated GELU).
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# generation_config.json keys copied into SamplingParams defaults (same names there).
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts settings of a sparse checkpoint (sizes in elements).

    ``scoring`` is how router logits become the top-k weights: ``"softmax_topk"`` (softmax over all
    experts in float32, then the top ``top_k``, renormalised to sum 1 when ``norm_topk_prob``; Qwen,
    Mixtral, OLMoE) or ``"topk_softmax"`` (the top ``top_k`` logits, then a softmax over them;
    Granite-MoE). ``sparse_layers`` lists the layers whose MLP is sparse (the others are dense with
    ``HFModelConfig.intermediate_size``). ``shared_expert_intermediate_size`` > 0 adds Qwen2-MoE's
    shared expert with its sigmoid gate.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    scoring: str = "softmax_topk"
    sparse_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0


@dataclass(frozen=True)
class HFModelConfig:
    """What Tandem needs from a decoder-only checkpoint's config (sizes in elements, lengths in tokens).

    ``eos_token_ids`` merges ``config.json`` and ``generation_config.json`` (each an int or a list).
    ``generation_defaults`` holds the present ones of temperature / top_p / top_k / repetition_penalty
    from ``generation_config.json``. ``sliding_window`` is None when every layer attends to the full
    context (for Qwen2/Qwen3 it is only set when ``use_sliding_window`` is true); ``layer_windows``
    then gives each layer's window (None: full attention), see ``layer_windows``.
    ``attention_bias``: the q/k/v projections have biases (always for Qwen2); o_proj has one too
    except in Qwen2 (see ``LlamaAttention.o_proj_bias``).
    """

    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    torch_dtype: str | None = None
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    moe: MoEConfig | None = None
    # NOTE: family extras, at their identity values for the families without them.
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to [-clip, clip] after the norm
    embedding_multiplier: float = 1.0  # Granite: embeddings scaled
    residual_multiplier: float = 1.0  # Granite: each block's output scaled before its residual add
    attention_multiplier: float | None = None  # Granite, Gemma: the attention scale instead of head_dim ** -0.5
    logits_scaling: float = 1.0  # Granite: logits divided by it
    hidden_act: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    layer_windows: tuple[int | None, ...] = ()  # per layer: sliding window (tokens) or None; () = all None
    attn_logit_softcapping: float | None = None  # Gemma2: scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma2/3: logits -> cap * tanh(logits / cap)
    rope_local: RopeConfig | None = None  # Gemma3: the sliding layers' rope (``rope`` is the global one)

    @property
    def max_model_len(self) -> int:
        """The longest context (tokens) of the model: ``max_position_embeddings`` (sliding-window layers
        attend to their last ``sliding_window`` tokens over the paged cache, so the window is no limit)."""
        return self.max_position_embeddings

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window in tokens (a query at position p sees keys p - window + 1 .. p,
        as transformers' ``sliding_window_overlay``), or None for full attention."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def kv_window(self) -> int | None:
        """The sliding window (tokens) of every layer when all of them slide (the largest one if they
        differ), else None: only then can KV blocks out of the window be freed (``KVCacheManager``)."""
        windows = self.layer_windows or (None,)
        return None if None in windows else max(w for w in windows if w is not None)


def load_hf_config(model_dir: Path | str) -> HFModelConfig:
    """Parse ``model_dir/config.json`` and, when present, ``model_dir/generation_config.json``.

    Raises:
        FileNotFoundError: ``model_dir`` or its ``config.json`` does not exist.
        CheckpointError: unknown architecture (the message lists the supported ones), an
            unsupported rope type or activation, or a malformed JSON file.
    """
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir} (expected a Hugging Face checkpoint folder)")
    cfg = _read_json(config_path)
    gen_path = model_dir / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.is_file() else {}
    architecture = _architecture(cfg, config_path)
    if cfg.get("use_bidirectional_attention"):
        raise CheckpointError(f"{config_path}: use_bidirectional_attention is not supported (causal models only)")
    try:
        return _build(cfg, gen, architecture, config_path)
    except KeyError as e:
        raise CheckpointError(f"{config_path}: missing required field {e.args[0]!r}") from None


def _build(cfg: dict[str, Any], gen: dict[str, Any], architecture: str, config_path: Path) -> HFModelConfig:
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    gemma = architecture in GEMMA_ARCHITECTURES
    window = _sliding_window(cfg)
    return HFModelConfig(
        architecture=architecture,
        model_type=str(cfg.get("model_type", "")),
        hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        intermediate_size=int(cfg["intermediate_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=rope_config(cfg, config_path, "full_attention"),
        vocab_size=int(cfg["vocab_size"]),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        # NOTE: Qwen2 always has q/k/v biases, whatever the config says (transformers hard-codes it).
        attention_bias=architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        or bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        bos_token_id=_first_int(cfg.get("bos_token_id"), gen.get("bos_token_id")),
        eos_token_ids=_merge_ids(cfg.get("eos_token_id"), gen.get("eos_token_id")),
        sliding_window=window,
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        generation_defaults={k: gen[k] for k in GENERATION_DEFAULT_KEYS if gen.get(k) is not None},
        moe=_moe_config(cfg, architecture),
        clip_qkv=None if cfg.get("clip_qkv") is None else float(cfg["clip_qkv"]),
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        attention_multiplier=_attention_multiplier(cfg, gemma),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)),
        hidden_act=_activation(cfg, config_path, "gelu_pytorch_tanh" if gemma else "silu"),
        layer_windows=_layer_windows(cfg, architecture, window, config_path),
        # NOTE: transformers' Gemma3Attention never passes attn_logit_softcapping to its attention (5.x).
        attn_logit_softcapping=_optional_float(cfg, "attn_logit_softcapping")
        if architecture == "Gemma2ForCausalLM" else None,
        final_logit_softcapping=_optional_float(cfg, "final_logit_softcapping") if gemma else None,
        rope_local=rope_config(cfg, config_path, "sliding_attention")
        if architecture == "Gemma3ForCausalLM" else None,
    )


def _optional_float(cfg: dict[str, Any], key: str) -> float | None:
    return None if cfg.get(key) is None else float(cfg[key])


def _attention_multiplier(cfg: dict[str, Any], gemma: bool) -> float | None:
    """The attention scale when it is not ``head_dim ** -0.5``: Granite's ``attention_multiplier``,
    Gemma's ``query_pre_attn_scalar ** -0.5``."""
    if gemma:
        return float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5
    return _optional_float(cfg, "attention_multiplier")


def _activation(cfg: dict[str, Any], path: Path, expected: str) -> str:
    """``hidden_activation`` (Gemma) or ``hidden_act``, which must be the family's ``expected`` one."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or expected
    if act != expected:
        raise CheckpointError(f"{path}: hidden_act {act!r} is not supported for this architecture (only {expected!r})")
    return _ACTIVATIONS[act]


def _layer_windows(cfg: dict[str, Any], architecture: str, window: int | None, path: Path) -> tuple[int | None, ...]:
    """Each layer's sliding window, from ``layer_types`` (written by transformers >= 4.54) or, in older
    files, each family's rule: Gemma2 alternates (even layers slide), Gemma3 has one global layer every
    ``sliding_window_pattern`` (default 6), Qwen2/Qwen3 slide from ``max_window_layers`` on, the others
    (Mistral, Mixtral) slide in every layer."""
    num_layers = int(cfg["num_hidden_layers"])
    if window is None:
        return ()
    if window < 1:
        raise CheckpointError(f"{path}: sliding_window must be >= 1, got {window}")
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise CheckpointError(f"{path}: layer_types has {len(types)} entries for {num_layers} layers")
        sliding = [t == "sliding_attention" for t in types]
    elif architecture == "Gemma2ForCausalLM":
        sliding = [i % 2 == 0 for i in range(num_layers)]
    elif architecture == "Gemma3ForCausalLM":
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
    elif architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        first = int(cfg.get("max_window_layers", num_layers))
        sliding = [i >= first for i in range(num_layers)]
    else:
        sliding = [True] * num_layers
    return tuple(window if s else None for s in sliding)


def _moe_config(cfg: dict[str, Any], architecture: str) -> MoEConfig | None:
    """The MoE settings of a sparse architecture (None for dense ones); field names per family."""
    if architecture not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM",
                            "OlmoeForCausalLM", "GraniteMoeForCausalLM"):
        return None
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    num_layers = int(cfg["num_hidden_layers"])
    if num_experts < 1:
        raise CheckpointError(f"{architecture}: num_experts must be >= 1, got {num_experts}")
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    top_k = int(cfg["num_experts_per_tok"])
    if not 1 <= top_k <= num_experts:
        raise CheckpointError(f"{architecture}: num_experts_per_tok {top_k} is not in 1..{num_experts}")
    qwen = architecture in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=int(cfg["moe_intermediate_size"] if qwen else cfg["intermediate_size"]),
        # NOTE: Mixtral always renormalises (transformers hard-codes it); Granite's softmax is over the k.
        norm_topk_prob=architecture == "MixtralForCausalLM" or bool(cfg.get("norm_topk_prob", False)),
        scoring="topk_softmax" if architecture == "GraniteMoeForCausalLM" else "softmax_topk",
        sparse_layers=sparse,
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
        if architecture == "Qwen2MoeForCausalLM" else 0,
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _architecture(cfg: dict[str, Any], path: Path) -> str:
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise CheckpointError(
        f"{path}: architecture {archs or '(none given)'} is not supported; "
        f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if "use_sliding_window" in cfg and not cfg["use_sliding_window"]:
        return None
    return int(window)


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return [int(v) for v in value]
    return [int(value)]


def _merge_ids(*values: Any) -> tuple[int, ...]:
    """Union of token ids (ints or lists), first-seen order."""
    out: list[int] = []
    for value in values:
        out += [i for i in _as_ids(value) if i not in out]
    return tuple(out)


def _first_int(*values: Any) -> int | None:
    for value in values:
        ids = _as_ids(value)
        if ids:
            return ids[0]
    return None
