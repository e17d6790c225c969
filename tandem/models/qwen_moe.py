"""Qwen2-MoE and Qwen3-MoE: the Qwen2 / Qwen3 blocks with sparse expert MLPs (``models/moe.py``).

Qwen3-MoE (e.g. Qwen3-30B-A3B: 128 experts, 8 per token) keeps Qwen3's per-head q/k norms;
Qwen2-MoE adds a shared expert every token goes through, gated by a sigmoid. ``decoder_sparse_step``
and ``mlp_only_layers`` make some layers dense (``MoEConfig.sparse_layers``).
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.hf_config import HFModelConfig
from tandem.models.moe import SparseMoeBlock
from tandem.models.qwen2 import Qwen2ForCausalLM
from tandem.models.qwen3 import Qwen3ForCausalLM


def qwen_moe_mlp(cfg: HFModelConfig, dtype: torch.dtype, layer: int) -> nn.Module | None:
    """A ``SparseMoeBlock`` for the sparse layers (checkpoint names ``mlp.gate``, ``mlp.experts.N.*``)."""
    assert cfg.moe is not None
    return SparseMoeBlock(cfg, dtype, "qwen") if layer in cfg.moe.sparse_layers else None


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    """Qwen2-MoE (Qwen1.5-MoE-A2.7B's architecture): Qwen2 attention, sparse MLPs with a shared expert."""

    def make_mlp(self, cfg: HFModelConfig, dtype: torch.dtype, layer: int) -> nn.Module | None:
        return qwen_moe_mlp(cfg, dtype, layer)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE: Qwen3 attention (q/k norms), sparse MLPs without a shared expert."""

    def make_mlp(self, cfg: HFModelConfig, dtype: torch.dtype, layer: int) -> nn.Module | None:
        return qwen_moe_mlp(cfg, dtype, layer)
