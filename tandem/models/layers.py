"""Shared layers of the Llama-like families: RMSNorm, rotary embedding, SiluAndMul, Linear, Embedding.

Parameters are created with ``torch.empty`` (no random init): the loader fills every one of them.
All layers work on flattened token batches ``[T, ...]`` (no batch dimension).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from tandem import kernels
from tandem.kernels import registry
from tandem.models.hf_config import RopeConfig

# NOTE: the fused C++ kernels (tandem.kernels) replace several PyTorch ops per layer, which is most
# of a decode step's Python overhead; each layer keeps its PyTorch code as the fallback and oracle.
_KERNEL_DTYPES = (torch.bfloat16, torch.float32)
# Tokens from which the torch backend multiplies bf16 by bf16 weights in fp32 (x.float() @ w.float()) on
# CPUs without bf16 dot products; below it, converting the weight on each call costs more than the
# slow bf16 GEMM saves (measured on Zen 3, docs/modules.md "Kernel paths").
FP32_MATMUL_MIN_TOKENS = 32


def _use_kernels(op: str, x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    return x.dtype in _KERNEL_DTYPES and (weight is None or weight.dtype == x.dtype) and registry.use(op)


def torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of the torch backend: bf16 ``x [T, K]`` with ``T >= FP32_MATMUL_MIN_TOKENS`` on a CPU
    without bf16 dot products is multiplied in fp32 (PyTorch's bf16 GEMM is several times slower
    there) and rounded to bf16 once; otherwise ``F.linear`` as is. Weights stay as they are in memory."""
    if (x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] >= FP32_MATMUL_MIN_TOKENS
            and registry.torch_compute_dtype(torch.bfloat16) == torch.float32):
        b = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), b).to(torch.bfloat16)
    return F.linear(x, weight, bias)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in float32 like transformers.

    ``forward(x [..., dim]) -> [..., dim]`` in ``x``'s dtype. ``forward(x, residual)`` with both
    ``[T, dim]`` is a pre-norm block's residual add fused with the norm (vLLM's
    ``fused_add_rms_norm``): ``residual = residual + x``, returns ``(norm(residual), residual)``;
    the kernel path does it in place (``x`` holds the normed values, ``residual`` the sum).
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        weight = self.weight
        if residual is not None:
            if _use_kernels("fused_add_rms_norm", x, weight) and x.is_contiguous() and residual.is_contiguous():
                kernels.fused_add_rms_norm(x, residual, weight, self.eps)
                return x, residual
            residual = residual + x
            return self.forward(residual), residual
        if _use_kernels("rms_norm", x, weight):
            return kernels.rms_norm(x.reshape(-1, x.shape[-1]), weight, self.eps).view(x.shape)
        input_dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        # NOTE: cast back before the weight multiply, as transformers does (matters in bfloat16).
        return weight * h.to(input_dtype)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` via ``F.linear``; weight ``[sum(output_sizes), input_size]``.

    A fused projection (q/k/v, gate/up) lists its checkpoint sub-modules in ``shard_names`` with
    their row counts in ``output_sizes``; the loader copies each into its row slice, so one GEMM
    replaces several.

    ``pack()`` (``pack_linears``, once the weights are loaded) re-lays a bf16 weight out for the
    packed bf16 kernel (``kernels.pack_bf16``; avx512_bf16 and avx2 variants): the ``weight``
    parameter is then gone (the memory is not held twice) and ``packed`` holds it; ``dense_weight()``
    gives the ``[N, K]`` weight either way.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: int | list[int],
        bias: bool,
        dtype: torch.dtype,
        shard_names: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        if shard_names and len(shard_names) != len(self.output_sizes):
            raise ValueError("shard_names and output_sizes must have the same length")
        self.shard_names = tuple(shard_names)
        out = sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(out, input_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out, dtype=dtype), requires_grad=False) if bias else None
        self.register_buffer("packed", None, persistent=False)

    def packable(self) -> bool:
        """Whether ``pack()`` would pack: a bf16 weight with an even K, not packed yet, and the packed
        kernel runs here (``registry.use("linear_bf16_packed")``: the avx512_bf16 and avx2 variants)."""
        w = self._parameters.get("weight")
        return (self.packed is None and w is not None and w.dtype == torch.bfloat16 and w.dim() == 2
                and w.shape[1] % 2 == 0 and registry.use("linear_bf16_packed"))

    def pack(self) -> torch.Tensor:
        """Replace the ``weight`` parameter by ``packed = kernels.pack_bf16(weight)`` (a buffer).

        Returns the packed tensor. Raises ``ValueError`` when not ``packable()``.
        """
        if not self.packable():
            raise ValueError("Linear.pack: needs an unpacked bf16 weight with even K and a kernel backend "
                             "with the packed kernel (avx512_bf16, avx2)")
        packed = kernels.pack_bf16(self.weight.detach())
        del self.weight
        self.packed = packed
        return packed

    def dense_weight(self) -> torch.Tensor:
        """The ``[N, K]`` weight: the parameter, or (after ``pack()``) a new unpacked copy."""
        if self.packed is not None:
            return kernels.unpack_bf16(self.packed)
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: at decode sizes stock bf16 GEMMs read weights at half the memory bandwidth; the
        # streaming kernels read them at the roofline (benchmarks/README.md).
        if self.packed is not None:
            if x.dtype == torch.bfloat16 and x.dim() == 2 and registry.use("linear_bf16_packed", tokens=x.shape[0]):
                return kernels.linear_bf16_packed(x, self.packed, self.bias)
            return torch_linear(x, self.dense_weight(), self.bias)
        if (x.dtype == torch.bfloat16 and x.dim() == 2 and self.weight.dtype == torch.bfloat16
                and registry.use("linear_bf16", tokens=x.shape[0])):
            return kernels.linear_bf16(x, self.weight, self.bias)
        return torch_linear(x, self.weight, self.bias)

    def kernel_linear(self, tokens: int) -> tuple[str, torch.Tensor, None, torch.Tensor | None] | None:
        """``(format, weight, scale, bias)`` for ``kernels.decoder_layer`` when ``forward`` over ``tokens``
        tokens of bf16 activations would call ``kernels.linear_bf16`` (``"bf16"``) or
        ``kernels.linear_bf16_packed`` (``"bf16_packed"``), else None (``forward`` is then used)."""
        if self.packed is not None:
            if registry.use("linear_bf16_packed", tokens=tokens):
                return "bf16_packed", self.packed, None, self.bias
            return None
        if self.weight.dtype == torch.bfloat16 and registry.use("linear_bf16", tokens=tokens):
            return "bf16", self.weight, None, self.bias
        return None


class Embedding(nn.Module):
    """Token embedding: ``forward(ids [T] int64) -> [T, dim]``.

    When the table is a tied LM head's weight and that head was packed (``pack_linears``), ``weight`` is
    gone and the rows are read from the head's ``packed`` tensor (``kernels.packed_rows``, the same values).
    """

    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim, dtype=dtype), requires_grad=False)
        self.register_buffer("packed", None, persistent=False)

    def share_packed(self, packed: torch.Tensor) -> None:
        """Read rows from ``packed`` (a ``kernels.pack_bf16`` of this table) and drop ``weight``."""
        del self.weight
        self.packed = packed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return kernels.packed_rows(self.packed, ids)
        return F.embedding(ids, self.weight)


def pack_linears(model: nn.Module) -> int:
    """Pack every ``packable()`` ``Linear`` of ``model`` for the packed bf16 kernel, in place.

    A tied LM head (its weight the embedding's parameter) is packed once and the embedding then reads its
    rows from the packed table. Nothing changes where the kernel does not run (the torch backend,
    float32 or quantized weights), or when ``$TANDEM_PACKED_BF16=0`` (the row-major ``linear_bf16`` kernel
    then runs: for side-by-side measurements). Returns the number of linears packed.
    """
    if os.environ.get("TANDEM_PACKED_BF16", "1") == "0":
        return 0
    owners: dict[int, list[Embedding]] = {}
    for module in model.modules():
        if isinstance(module, Embedding) and module.packed is None:
            owners.setdefault(id(module.weight), []).append(module)
    count = 0
    for module in list(model.modules()):
        if not isinstance(module, Linear) or not module.packable():
            continue
        tied = owners.get(id(module.weight), [])
        packed = module.pack()
        for embedding in tied:
            embedding.share_packed(packed)
        count += 1
    return count


class SiluAndMul(nn.Module):
    """SwiGLU gate (Shazeer 2020): ``x [..., 2d] -> silu(x[..., :d]) * x[..., d:]`` (gate first)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and _use_kernels("silu_and_mul", x):
            return kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """GeGLU gate (Shazeer 2020) of Gemma: ``x [..., 2d] -> gelu_tanh(x[..., :d]) * x[..., d:]`` (gate first),
    with transformers' ``gelu_pytorch_tanh`` (``F.gelu(approximate="tanh")``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def rope_inv_freq(head_dim: int, rope: RopeConfig, long: bool = False) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` float32 (RoFormer, Su et al. 2021).

    "linear" divides them by ``rope.factor`` (position interpolation, as transformers'
    ``_compute_linear_scaling_rope_parameters``). "llama3" applies Llama 3.1's frequency-dependent
    scaling (Meta's reference ``apply_scaling``, as in transformers' ``_compute_llama3_parameters``):
    wavelengths shorter than ``original_max / high_freq_factor`` are kept, longer than
    ``original_max / low_freq_factor`` divided by ``factor``, and those between interpolated smoothly.
    "longrope" divides frequency ``i`` by ``short_factor[i]`` (``long_factor[i]`` when ``long``), as
    transformers' ``_compute_longrope_parameters``.

    Raises:
        ValueError: an unsupported ``rope.rope_type``.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if rope.rope_type == "longrope":
        factors = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
        return 1.0 / (factors * rope.theta**exponent)
    inv_freq = 1.0 / (rope.theta**exponent)
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        raise ValueError(f"rope type {rope.rope_type!r} is not supported")
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _cos_sin(inv_freq: torch.Tensor, num_positions: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [num_positions, 2 * len(inv_freq)]`` float32 for positions ``0 ..``, times ``scale``."""
    freqs = torch.arange(num_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    if scale == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * scale, emb.sin() * scale


class RotaryEmbedding(nn.Module):
    """Rotary position embedding tables in the rotate-half layout of Hugging Face checkpoints.

    ``cos``/``sin`` caches ``[rows, R]`` are computed once in float32; at use they are cast to the
    model dtype (as transformers does). ``forward(positions [T] int64, dtype, prompt_lens=None)``
    returns ``(cos, sin)``, each ``[T, 1, R]``, for ``apply_rotary``; a model computes them once
    per step and shares them across layers. ``R = rotary_dim(head_dim, rope)``: ``head_dim`` unless
    ``partial_rotary_factor`` < 1 (then only each head's first R dims rotate, ``apply_partial_rotary``).

    "longrope" keeps two tables, the short factors' for positions below ``original_max_position_embeddings``
    (``O``) and the long factors' for every position, both scaled by ``attention_factor``. transformers picks
    one set per forward call: the long one when the call's largest position + 1 exceeds ``O``. Here a
    token at position ``p`` of a request whose prompt has ``L`` tokens (``prompt_lens [T]``) uses the long
    set iff ``L > O`` or ``p >= O``: every prompt token as transformers' forward of the whole prompt,
    every generated token as its forward with a KV cache, independent of chunking and batching.
    NOTE: transformers' ``Phi3ForCausalLM.generate`` also recomputes the whole cache with the long
    factors once a sequence whose prompt had ``<= O`` tokens grows past ``O``; Tandem keeps the cached
    short-factor K/V (paged blocks may be shared), so from position ``O`` on such a sequence may differ.
    Without ``prompt_lens`` only ``p >= O`` decides.
    """

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.long_offset = 0
        dim = rotary_dim(head_dim, rope)
        cos, sin = _cos_sin(rope_inv_freq(dim, rope), max_positions, rope.attention_factor)
        if rope.rope_type == "longrope":
            self.long_offset = min(rope.original_max_position_embeddings, max_positions)
            long_cos, long_sin = _cos_sin(rope_inv_freq(dim, rope, long=True), max_positions, rope.attention_factor)
            cos = torch.cat((cos[: self.long_offset], long_cos))
            sin = torch.cat((sin[: self.long_offset], long_sin))
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype, prompt_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = positions
        if self.long_offset:
            long = positions >= self.long_offset
            if prompt_lens is not None:
                long |= prompt_lens > self.long_offset
            rows = positions + long * self.long_offset
        # NOTE: index_select, not cache[rows]: the same rows without advanced indexing's set-up (a decode step's
        # two look-ups cost tens of microseconds that way)
        cos = self.cos_cache.index_select(0, rows).to(dtype).unsqueeze(1)
        sin = self.sin_cache.index_select(0, rows).to(dtype).unsqueeze(1)
        return cos, sin


def rotary_dim(head_dim: int, rope: RopeConfig) -> int:
    """How many of each head's first dims rotate: ``int(head_dim * partial_rotary_factor)``, as transformers."""
    return int(head_dim * rope.partial_rotary_factor)


def apply_partial_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary`` on the first ``R = cos.shape[-1]`` dims of each head of ``q [T, H, D]``, ``k [T, KV, D]``;
    dims ``R ..`` pass through (transformers' ``apply_rotary_pos_emb`` with ``partial_rotary_factor``)."""
    r = cos.shape[-1]
    if r == q.shape[-1]:
        return apply_rotary(q, k, cos, sin)
    q_rot, k_rot = apply_rotary(q[..., :r], k[..., :r], cos, sin)
    return torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, H, D]`` and ``k [T, KV, D]`` by ``cos, sin [T, 1, D]`` (rotate-half layout)."""
    if _use_kernels("rotary", q, cos) and cos.shape == sin.shape == (q.shape[0], 1, q.shape[2]) and all(
        x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in (q, k)
    ):
        return kernels.rotary(q, cos, sin), kernels.rotary(k, cos, sin)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` in place by ``cos, sin [T, 1, D]`` and return it; ``x`` may be a view
    with any token stride (heads contiguous), e.g. the q and k columns of a fused qkv output as
    ``[T, H + KV, D]``, so one call rotates both without a copy. Same values as ``apply_rotary``.
    """
    if (_use_kernels("rotary_", x, cos) and cos.shape == sin.shape == (x.shape[0], 1, x.shape[2])
            and x.stride(2) == 1 and x.stride(1) == x.shape[2]):
        kernels.rotary_(x, cos, sin)
        return x
    return x.copy_(x * cos + _rotate_half(x) * sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
