"""OLMoE (Muennighoff et al. 2024): Llama attention with q/k norms over the whole projection, optional
q/k/v clipping, and a sparse MLP in every layer (64 experts, 8 per token, no renormalisation).
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.attention import AttentionBackend
from tandem.models.hf_config import HFModelConfig
from tandem.models.layers import RMSNorm
from tandem.models.llama import LlamaAttention, LlamaForCausalLM
from tandem.models.moe import SparseMoeBlock


class OlmoeAttention(LlamaAttention):
    """``q_norm`` / ``k_norm`` are RMSNorms over all ``heads * head_dim`` columns (not per head, as in
    Qwen3); then ``clip_qkv`` clamps q, k and v (``LlamaAttention.forward``)."""

    has_qk_norm = True

    def __init__(self, cfg: HFModelConfig, dtype: torch.dtype, backend: AttentionBackend) -> None:
        super().__init__(cfg, dtype, backend)
        self.q_norm = RMSNorm(cfg.num_heads * cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(cfg.num_kv_heads * cfg.head_dim, cfg.rms_norm_eps, dtype)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, H, D]``, ``k [T, KV, D]`` normalised over each token's ``H * D`` (``KV * D``) values."""
        t = q.shape[0]
        return (self.q_norm(q.reshape(t, -1)).view(q.shape), self.k_norm(k.reshape(t, -1)).view(k.shape))


class OlmoeForCausalLM(LlamaForCausalLM):
    """OLMoE causal LM; checkpoint names ``mlp.gate`` and ``mlp.experts.N.{gate,up,down}_proj``."""

    attention_cls = OlmoeAttention

    def make_mlp(self, cfg: HFModelConfig, dtype: torch.dtype, layer: int) -> nn.Module | None:
        return SparseMoeBlock(cfg, dtype, "qwen")
