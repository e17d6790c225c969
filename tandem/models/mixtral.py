"""Mixtral: Mistral's blocks with a sparse MLP in every layer (Jiang et al. 2024, "Mixtral of Experts").

The router's softmax over all experts is renormalised over the top k (``norm_topk_prob`` is implied).
Checkpoint names: ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.N.{w1, w3, w2}`` (gate, up,
down).
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.hf_config import HFModelConfig
from tandem.models.llama import LlamaForCausalLM
from tandem.models.moe import SparseMoeBlock


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral causal LM; see the module docstring."""

    def make_mlp(self, cfg: HFModelConfig, dtype: torch.dtype, layer: int) -> nn.Module | None:
        return SparseMoeBlock(cfg, dtype, "mixtral")
