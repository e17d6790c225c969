"""Qwen3: Llama with a per-head RMSNorm on queries and keys before RoPE (no q/k/v biases).

``head_dim`` comes from the config and may differ from ``hidden_size / num_heads``.
"""

from __future__ import annotations

import torch

from tandem.attention import AttentionBackend
from tandem.models.hf_config import HFModelConfig
from tandem.models.layers import RMSNorm
from tandem.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    """Adds ``q_norm`` / ``k_norm`` (RMSNorm over ``head_dim``, shared by all heads) before RoPE."""

    has_qk_norm = True

    def __init__(self, cfg: HFModelConfig, dtype: torch.dtype, backend: AttentionBackend) -> None:
        super().__init__(cfg, dtype, backend)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, H, D]``, ``k [T, KV, D]`` normalised per head."""
        return self.q_norm(q), self.k_norm(k)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense causal LM; see ``Qwen3Attention``."""

    attention_cls = Qwen3Attention
