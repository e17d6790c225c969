"""Llama (and Mistral) decoder over a paged KV cache; the base the Qwen families extend.

Parameter names mirror the Hugging Face checkpoint (``model.layers.N.self_attn...``) except the
fused projections ``qkv_proj`` (q/k/v) and ``gate_up_proj`` (gate/up), which the loader fills
from the separate checkpoint tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tandem import kernels
from tandem.attention import AttentionBackend, AttentionMetadata, select_backend
from tandem.kernels import registry
from tandem.models.fused_plan import fused_plan
from tandem.models.hf_config import HFModelConfig
from tandem.models.layers import (
    Embedding,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    apply_partial_rotary,
    apply_rotary_,
    rotary_dim,
)

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each [num_blocks, block_size, KV, D]
Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [T, 1, D]


class LlamaAttention(nn.Module):
    """Self-attention with fused q/k/v, RoPE and grouped-query heads; K/V go to the paged cache."""

    # NOTE: None = o_proj has a bias iff ``attention_bias`` (Llama, Qwen3); Qwen2 sets False.
    o_proj_bias: bool | None = None
    # True when ``norm_qk`` is not the identity (Qwen3): q and k are then normalised into new tensors
    # before RoPE instead of being rotated in place in the qkv output.
    has_qk_norm: bool = False
    # The checkpoint tensors filling ``qkv_proj``; ``()`` when the checkpoint stores it fused (Phi-3).
    qkv_shard_names: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")

    def __init__(self, cfg: HFModelConfig, dtype: torch.dtype, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(cfg.hidden_size, self.split_sizes, cfg.attention_bias, dtype, self.qkv_shard_names)
        o_bias = cfg.attention_bias if self.o_proj_bias is None else self.o_proj_bias
        self.o_proj = Linear(q_size, cfg.hidden_size, o_bias, dtype)
        self.scale = cfg.attention_multiplier if cfg.attention_multiplier is not None else self.head_dim**-0.5
        self.clip_qkv = cfg.clip_qkv
        self.partial_rotary = rotary_dim(self.head_dim, cfg.rope) != self.head_dim  # Phi-4-mini
        self.backend = backend
        # NOTE: per layer, set by LlamaModel from ``cfg.layer_window(i)``: keys p - window + 1 .. p only.
        self.sliding_window: int | None = None
        self.softcap = cfg.attn_logit_softcapping  # Gemma2: scores -> cap * tanh(scores / cap)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook before RoPE (identity here; Qwen3 normalises each head)."""
        return q, k

    def forward(
        self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """``x [T, hidden] -> [T, hidden]``. Changes: writes this step's K/V into ``kv_cache``.

        q, k and v stay views of the fused qkv output (the backends take any token stride); without a
        q/k norm one in-place rotary call rotates the q and k columns together.
        """
        qkv = self.qkv_proj.forward(x)
        t, heads, kv_heads, head_dim = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q_end = heads * head_dim
        k_end = q_end + kv_heads * head_dim
        q = qkv[:, :q_end].view(t, heads, head_dim)
        k = qkv[:, q_end:k_end].view(t, kv_heads, head_dim)
        v = qkv[:, k_end:].view(t, kv_heads, head_dim)
        if self.has_qk_norm or self.clip_qkv is not None or self.partial_rotary:
            q, k = self.norm_qk(q, k)
            if self.clip_qkv is not None:  # OLMoE: after the norm
                c = self.clip_qkv
                q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
            q, k = apply_partial_rotary(q, k, *rope)
        else:
            apply_rotary_(qkv[:, :k_end].view(t, heads + kv_heads, head_dim), *rope)
        out = self.backend(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window, self.softcap)
        return self.o_proj.forward(out.flatten(1))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward with a fused gate/up projection: ``[T, hidden] -> [T, hidden]``."""

    def __init__(
        self, cfg: HFModelConfig, dtype: torch.dtype, shard_names: tuple[str, ...] = ("gate_proj", "up_proj")
    ) -> None:
        """``shard_names``: the checkpoint tensors filling ``gate_up_proj`` (``()``: stored fused, Phi-3)."""
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, [inter, inter], cfg.mlp_bias, dtype, shard_names)
        self.act = SiluAndMul()
        self.down_proj = Linear(inter, cfg.hidden_size, cfg.mlp_bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: ``.forward`` skips nn.Module.__call__ (no hooks are used); ~10 calls per layer per step.
        return self.down_proj.forward(self.act.forward(self.gate_up_proj.forward(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x))``, then ``h + mlp(norm(h))``.

    As in vLLM the residual stream is carried separately and each residual add is fused with the
    norm that follows it (``RMSNorm.forward(x, residual)``): ``forward(x, residual)`` returns the
    MLP output and the residual stream before its add, which the next layer's (or the final) norm
    performs.
    """

    def __init__(
        self,
        cfg: HFModelConfig,
        dtype: torch.dtype,
        attention_cls: type[LlamaAttention],
        backend: AttentionBackend,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = attention_cls(cfg, dtype, backend)
        self.mlp = mlp if mlp is not None else LlamaMLP(cfg, dtype)
        self.residual_multiplier = cfg.residual_multiplier
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        fused: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, hidden]`` (the embeddings when ``residual`` is None, else the previous layer's MLP
        output) -> ``(mlp_out, residual)``, each ``[T, hidden]``; the layer's output is their sum.

        ``fused``: the caller checked that the step suits ``kernels.decoder_layer`` (see
        ``LlamaModel.fused_step``); the layer then runs as one C++ call when its own modules allow it
        (each linear has a kernel for the step: bf16 ``Linear`` or ``QuantizedLinear``; no q/k norm), with
        the same result as the code below.

        Changes: may overwrite ``x`` and ``residual`` in place; writes K/V into ``kv_cache``.
        """
        if fused:
            out = self.forward_fused(x, residual, rope, kv_cache, meta)
            if out is not None:
                return out
        if residual is None:
            residual, x = x, self.input_layernorm.forward(x)
        else:
            x, residual = self.input_layernorm.forward(x, residual)
        x = self.self_attn.forward(x, rope, kv_cache, meta)
        if self.residual_multiplier != 1.0:  # Granite
            x = x * self.residual_multiplier
        x, residual = self.post_attention_layernorm.forward(x, residual)
        x = self.mlp.forward(x)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        return x, residual

    def forward_fused(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``forward`` as one ``kernels.decoder_layer`` call, or None when this layer's modules do not suit
        it (a q/k norm, a linear without a kernel for this step). The caller checks the step
        (``LlamaModel.fused_step``).
        """
        plan = fused_plan(self, x.shape[0], self._suits_fused)
        if plan is None:
            return None
        attn = plan.modules[1]
        # NOTE: the fused layer attends without a window: only when every key is inside it.
        if attn.sliding_window is not None and int(meta.seq_lens.max()) > attn.sliding_window:
            return None
        return kernels.decoder_layer(
            x, residual, plan.input_norm, plan.post_norm, plan.eps, plan.linears, rope[0], rope[1], kv_cache[0],
            kv_cache[1], meta, attn.num_heads, attn.num_kv_heads, attn.scale, attn.backend.kernel_max_query_len,
        )

    def _suits_fused(self) -> bool:
        """Whether this layer's own modules allow ``kernels.decoder_layer`` (asked when its plan is built,
        ``models/fused_plan.py``: the plan is rebuilt when quantize_model or a deepcopy replaced a module)."""
        attn = self.self_attn
        return not (attn.has_qk_norm or attn.clip_qkv is not None or attn.partial_rotary
                    or self.residual_multiplier != 1.0 or type(self.mlp) is not LlamaMLP or attn.softcap is not None)


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm: ``(ids [T], positions [T]) -> hidden [T, hidden]``.

    Layer i's attention gets its sliding window ``cfg.layer_window(i)``. A family with other layers
    sets ``layer_cls``.
    """

    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(
        self,
        cfg: HFModelConfig,
        dtype: torch.dtype,
        max_positions: int,
        attention_cls: type[LlamaAttention],
        backend: AttentionBackend,
        make_mlp: Callable[[int], nn.Module | None] = lambda layer: None,
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.embedding_multiplier = cfg.embedding_multiplier
        self.layers = nn.ModuleList(
            self.layer_cls(cfg, dtype, attention_cls, backend, make_mlp(i)) for i in range(cfg.num_layers)
        )
        for i, layer in enumerate(self.layers):
            layer.self_attn.sliding_window = cfg.layer_window(i)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        prompt_lens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:  # Granite
            x = x * self.embedding_multiplier
        rope = self.rotary(positions, x.dtype, prompt_lens)
        residual, fused = None, self.fused_step(x)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer.forward(x, residual, rope, kv_cache, meta, fused)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm(x, residual)[0]

    def fused_step(self, x: torch.Tensor) -> bool:
        """Whether this step's layers may run as one C++ call each (``LlamaDecoderLayer.forward_fused``):
        bf16 activations, few enough tokens (``T``) for the registry's ``decoder_layer`` limit, and an
        attention backend whose kernel attends every row (each layer checks its own linears).
        """
        if x.dtype != torch.bfloat16 or not self.layers:
            return False
        t = x.shape[0]
        return (t <= getattr(self.layers[0].self_attn.backend, "kernel_max_query_len", 0)
                and registry.use("decoder_layer", tokens=t))


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral causal LM over a paged KV cache (Mistral's ``sliding_window`` in every layer).

    Args:
        cfg: the checkpoint config.
        dtype: parameter and activation dtype (bfloat16 or float32).
        max_positions: size of the RoPE tables (tokens); positions must stay below it.
        backend: paged attention implementation (default: ``select_backend``'s choice).
    """

    attention_cls: type[LlamaAttention] = LlamaAttention
    model_cls: type[LlamaModel] = LlamaModel

    def __init__(
        self,
        cfg: HFModelConfig,
        dtype: torch.dtype,
        max_positions: int,
        backend: AttentionBackend | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        backend = backend if backend is not None else select_backend(cfg.head_dim, dtype)
        self.model = self.model_cls(cfg, dtype, max_positions, self.attention_cls, backend,
                                    lambda layer: self.make_mlp(cfg, dtype, layer))
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype)
        if cfg.tie_word_embeddings:
            # NOTE: one shared Parameter; named_parameters() then lists only the embedding, so the
            # loader never looks for lm_head.weight.
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_mlp(self, cfg: HFModelConfig, dtype: torch.dtype, layer: int) -> nn.Module | None:
        """The feed-forward block of decoder layer ``layer``; None = the dense ``LlamaMLP``.

        Mixture-of-experts families return a ``models.moe.SparseMoeBlock`` for their sparse layers.
        """
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        prompt_lens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``input_ids, positions [T] int64 -> hidden [T, hidden]`` in the model dtype.

        ``kv_caches`` holds one ``(k_cache, v_cache)`` per layer. ``prompt_lens [T]`` int64: the prompt
        length (tokens) of each token's request; only "longrope" RoPE reads it (``RotaryEmbedding``).
        Changes: writes K/V at ``meta.slot_mapping`` in every layer's cache.
        """
        return self.model(input_ids, positions, kv_caches, meta, prompt_lens)

    def compute_logits(self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """``hidden [N, hidden] -> logits [N, vocab]`` in ``dtype`` (None: the model dtype, no copy).

        NOTE: the GEMM runs in the model dtype and only its output is cast (as vLLM does): a float32
        copy of a large vocabulary's lm_head would cost memory and time on every step. The sampler
        takes model-dtype logits and casts only the rows that need float32.
        """
        logits = self.lm_head(hidden)
        if self.config.logits_scaling != 1.0:  # Granite
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        if cap is not None:  # Gemma2/3, in the model dtype as transformers
            logits = torch.tanh(logits / cap) * cap
        return logits if dtype is None else logits.to(dtype)
