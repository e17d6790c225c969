"""Phi-3 / Phi-3.5 / Phi-4 (Abdin et al. 2024, "Phi-3 Technical Report"): Llama blocks whose checkpoint stores
q/k/v as one ``self_attn.qkv_proj`` ``[(H + 2 KV) * D, hidden]`` and gate/up as one ``mlp.gate_up_proj``
``[2I, hidden]`` (gate rows first). Tandem's fused projections have exactly these layouts, so the loader
copies each as it is (no shard names). Long-context checkpoints use "longrope" RoPE (legacy name "su";
``layers.RotaryEmbedding`` says which tokens take the long factors). No biases.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.hf_config import HFModelConfig
from tandem.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class Phi3Attention(LlamaAttention):
    """``qkv_proj`` is one checkpoint tensor (q rows, then k, then v)."""

    qkv_shard_names = ()


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 causal LM; see the module docstring."""

    attention_cls = Phi3Attention

    def make_mlp(self, cfg: HFModelConfig, dtype: torch.dtype, layer: int) -> nn.Module | None:
        return LlamaMLP(cfg, dtype, shard_names=())
