"""Gemma 2 and Gemma 3 (text): Llama's blocks with Gemma's deltas (Gemma Team 2024, "Gemma 2: Improving
Open Language Models at a Practical Size"; 2025, "Gemma 3 Technical Report").

- embeddings scaled by ``sqrt(hidden_size)``, rounded to the model dtype first (as transformers does);
- RMSNorm scaling by ``1 + weight`` in float32, cast once (``GemmaRMSNorm``), and four norms per layer:
  before and after attention, before and after the feed-forward block (``GemmaDecoderLayer``);
- a GeGLU feed-forward with ``gelu_pytorch_tanh``;
- queries scaled by ``query_pre_attn_scalar ** -0.5`` (``HFModelConfig.attention_multiplier``);
- sliding-window layers (``HFModelConfig.layer_windows``: Gemma2 alternates, Gemma3 has one global layer
  in ``sliding_window_pattern``) over the paged cache;
- Gemma2: attention logit soft-capping (``attn_logit_softcapping``); both: final logit soft-capping
  (``LlamaForCausalLM.compute_logits``);
- Gemma3: per-head q/k RMSNorms (``1 + weight``) before RoPE, and two ropes: the sliding layers' local
  base (``rope_local``), the global layers' base with its optional scaling (``rope``).

Checkpoint names are transformers': ``model.layers.N.{input_layernorm, post_attention_layernorm,
pre_feedforward_layernorm, post_feedforward_layernorm}`` and, for Gemma3, ``self_attn.{q_norm, k_norm}``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tandem.attention import AttentionBackend, AttentionMetadata
from tandem.models.hf_config import HFModelConfig
from tandem.models.layers import GeluTanhAndMul, RMSNorm, RotaryEmbedding
from tandem.models.llama import (
    KVCache,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    Rope,
)
from tandem.models.qwen3 import Qwen3Attention


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``(x * rsqrt(mean(x^2) + eps)) * (1 + weight)`` in float32, cast to ``x``'s dtype
    at the end (transformers' ``Gemma2RMSNorm``; the checkpoint stores ``weight``, zero-centred).

    ``forward(x [..., dim]) -> [..., dim]``; ``forward(x, residual)`` returns ``(norm(residual + x),
    residual + x)`` (the final norm's residual add). PyTorch ops only (the RMSNorm kernels scale by
    ``weight`` and round before it).
    """

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            residual = residual + x
            return self.forward(residual), residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(LlamaMLP):
    """GeGLU feed-forward (``gelu_pytorch_tanh`` gate), fused gate/up projection: ``[T, hidden] -> [T, hidden]``."""

    def __init__(self, cfg: HFModelConfig, dtype: torch.dtype) -> None:
        super().__init__(cfg, dtype)
        self.act = GeluTanhAndMul()


class Gemma3Attention(Qwen3Attention):
    """Gemma3's attention: per-head ``q_norm`` / ``k_norm`` (``GemmaRMSNorm`` over ``head_dim``) before RoPE;
    no score soft-capping (transformers' ``Gemma3Attention`` does not apply ``attn_logit_softcapping``)."""

    def __init__(self, cfg: HFModelConfig, dtype: torch.dtype, backend: AttentionBackend) -> None:
        super().__init__(cfg, dtype, backend)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Sandwich-norm block: ``h = x + post_attn_norm(attn(input_norm(x)))``, then
    ``h + post_ff_norm(mlp(pre_ff_norm(h)))``.

    ``forward(x, residual, ...)`` keeps ``LlamaDecoderLayer``'s contract (the layer's input is ``x +
    residual``, or ``x`` when ``residual`` is None; returns ``(mlp_out, h)`` whose sum is the output) so
    ``LlamaModel``'s loop and final norm serve it; it never runs as the fused C++ layer.
    """

    def __init__(
        self,
        cfg: HFModelConfig,
        dtype: torch.dtype,
        attention_cls: type[LlamaAttention],
        backend: AttentionBackend,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__(cfg, dtype, attention_cls, backend, mlp if mlp is not None else GemmaMLP(cfg, dtype))
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(dim, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        fused: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x, residual [T, hidden]`` -> ``(mlp_out, h)``, each ``[T, hidden]``.

        Changes: writes K/V into ``kv_cache``.
        """
        h = x if residual is None else residual + x
        attn = self.self_attn.forward(self.input_layernorm(h), rope, kv_cache, meta)
        h = h + self.post_attention_layernorm(attn)
        return self.post_feedforward_layernorm(self.mlp.forward(self.pre_feedforward_layernorm(h))), h


class GemmaModel(LlamaModel):
    """``LlamaModel`` with scaled embeddings, ``GemmaRMSNorm`` as the final norm, and (Gemma3) the local
    rope for the sliding-window layers: ``(ids [T], positions [T]) -> hidden [T, hidden]``."""

    layer_cls = GemmaDecoderLayer

    def __init__(
        self,
        cfg: HFModelConfig,
        dtype: torch.dtype,
        max_positions: int,
        attention_cls: type[LlamaAttention],
        backend: AttentionBackend,
        make_mlp: Callable[[int], nn.Module | None] = lambda layer: None,
    ) -> None:
        super().__init__(cfg, dtype, max_positions, attention_cls, backend, make_mlp)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # NOTE: transformers multiplies by the scale rounded to the weights' dtype (e.g. bf16).
        self.embed_scale = float(torch.tensor(cfg.hidden_size**0.5, dtype=dtype))
        self.rotary_local = None if cfg.rope_local is None else RotaryEmbedding(cfg.head_dim, max_positions,
                                                                                cfg.rope_local)
        self.local_rope = [cfg.rope_local is not None and cfg.layer_window(i) is not None
                           for i in range(cfg.num_layers)]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        prompt_lens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * self.embed_scale
        rope = self.rotary(positions, x.dtype, prompt_lens)
        rope_local = rope if self.rotary_local is None else self.rotary_local(positions, x.dtype, prompt_lens)
        residual = None
        for layer, local, kv_cache in zip(self.layers, self.local_rope, kv_caches, strict=True):
            x, residual = layer.forward(x, residual, rope_local if local else rope, kv_cache, meta)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm(x, residual)[0]


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 causal LM (see the module docstring); same constructor as ``LlamaForCausalLM``."""

    model_cls = GemmaModel


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text causal LM (transformers' ``Gemma3ForCausalLM`` / ``Gemma3TextConfig``; the multimodal
    ``Gemma3ForConditionalGeneration`` is not supported); see the module docstring."""

    attention_cls = Gemma3Attention
    model_cls = GemmaModel
