"""Granite-MoE (IBM Granite 3.x MoE, e.g. granite-3.1-3b-a800m): Llama blocks with four scalar
multipliers and a sparse MLP in every layer.

``embedding_multiplier`` scales the embeddings, ``residual_multiplier`` each block's output before its
residual add, ``attention_multiplier`` replaces ``head_dim ** -0.5``, and logits are divided by
``logits_scaling`` (all in ``HFModelConfig``, applied by the Llama classes). The router takes the top
k logits, then a softmax over them (``MoEConfig.scoring = "topk_softmax"``). Checkpoint names:
``block_sparse_moe.router.layer``, ``block_sparse_moe.input_linear`` ``[E, 2I, H]`` (gate then up) and
``block_sparse_moe.output_linear`` ``[E, H, I]``.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.hf_config import HFModelConfig
from tandem.models.llama import LlamaForCausalLM
from tandem.models.moe import SparseMoeBlock


class GraniteMoeForCausalLM(LlamaForCausalLM):
    """Granite-MoE causal LM; see the module docstring."""

    def make_mlp(self, cfg: HFModelConfig, dtype: torch.dtype, layer: int) -> nn.Module | None:
        return SparseMoeBlock(cfg, dtype, "granite")
