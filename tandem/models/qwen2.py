"""Qwen2 / Qwen2.5: Llama with biases on the q/k/v projections (none on o_proj)."""

from __future__ import annotations

from tandem.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    """q/k/v carry biases (``HFModelConfig.attention_bias`` is forced True for Qwen2); o_proj has none."""

    o_proj_bias = False


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 causal LM: same blocks, norms, RoPE and SwiGLU as Llama; see ``Qwen2Attention``."""

    attention_cls = Qwen2Attention
