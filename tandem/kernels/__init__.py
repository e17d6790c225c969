"""Tandem's own CPU kernels (C++, one build per instruction set, built just in time; see ``build.py``).

Each wrapper takes the same tensors as its PyTorch reference and calls the selected variant
(``backend()``: ``avx512_bf16`` or ``avx2``). Callers ask the kernel registry (``registry.use(op,
tokens=T)``, ``tandem/kernels/registry.py``) whether to call it for their operator and size, and keep
the PyTorch path as the fallback.

The avx2 linear kernels compute each (token, row) output with one 8-lane fp32 accumulator over K in
order and a fixed final sum, whatever the number of tokens: a token's outputs are bit-identical
alone, in any batch, or among speculative tokens (batch invariance). Their quantized formats
quantize the activations as llama.cpp's AVX2 path does (ggml-quants.c ``quantize_row_q8_0``): per
token and block of 32 along K, ``dx = max|x_b| / 127``, ``xq = round(x / dx)``; exact integer dot
products with the weight codes, one fp32 multiply by ``d * dx`` per block. Rounding x moves each
value by at most ``dx / 2``, so an output differs from ``x @ dequant(w).T`` by at most the
activation bound ``sum_b max|x_b| / 254 * sum_{j in b} |w_j|`` plus fp32 rounding of the block
terms and the output's bf16 rounding.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tandem.kernels.build import load_extension, selected_variant, unsupported_reason

__all__ = [
    "available", "backend", "dequantize", "linear_bf16", "linear_bf16_packed", "pack_bf16", "packed_rows",
    "unpack_bf16", "moe_bf16", "moe_int4", "moe_int8", "moe_q8_0", "linear_int4",
    "moe_kquant", "linear_int8", "linear_max_tokens", "paged_attention", "rms_norm", "rotary", "silu_and_mul", "argmax",
    "supports_window_softcap", "unavailable_reason",
]


def linear_max_tokens() -> int:
    """The largest token count (rows of ``x``) the selected variant's ``linear_bf16`` kernel should get:
    the kernel registry's limit: any count (``registry.UNLIMITED``) on both variants, since one reduction
    order for every M keeps batch invariance (on avx512_bf16 oneDNN's GEMM would be faster above ~16
    tokens; on avx2 the blocked fp32 GEMM beats bf16 ``F.linear`` on CPUs without bf16 dot products),
    0 for the torch backend."""
    from tandem.kernels import registry

    return registry.max_tokens("linear_bf16")


def available(op: str | None = None) -> bool:
    """True when a compiled variant is loaded (built on the first call) and, if ``op`` is given,
    that operator (a function name of this module, e.g. ``"linear_q4_1"``) runs on a compiled kernel:
    the loaded variant's own, or for an operator of the kernel registry the variant it routes to
    (``registry.ROUTES``: the avx2-only operators on an ``avx512_bf16`` CPU)."""
    module = load_extension()
    if module is None or op is None:
        return module is not None
    from tandem.kernels import registry

    if op in registry.LIMITS:
        return registry.backend_for(op) != "torch"
    return hasattr(module, op)


def backend() -> str:
    """The kernel backend in use: ``avx512_bf16``, ``avx2`` or ``torch`` (no compiled variant)."""
    return selected_variant() or "torch"


def unavailable_reason(op: str | None = None) -> str | None:
    """Why ``available(op)`` is false (for logs and test skips), or None when it is true."""
    if available(op):
        return None
    if available():
        return f"the {backend()} kernels have no {op}"
    return unsupported_reason() or "the build failed (its error was logged as a warning)"


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T (+ bias [N])`` -> ``[M, N]``, all bf16, fp32 accumulation.

    avx512_bf16: reads ``weight`` row by row in place (streaming, ``vdpbf16ps``); meant for small M
    (decode). avx2: any M (a GEMV for M <= 3, a cache-blocked fp32 GEMM above), batch invariant (see
    above). Both match ``F.linear`` in fp32 up to fp32 summation order and the final bf16 rounding
    (products of bf16 values are exact in fp32).

    Raises:
        RuntimeError: wrong dtypes or shapes (raised by the kernel).
    """
    return load_extension().linear_bf16(x, weight, bias)


PACK_ROWS = 64  # rows per panel of a packed bf16 weight (csrc/packed_bf16.h kPanel)


def _panels(packed: torch.Tensor) -> torch.Tensor:
    """The ``[P, K / 2, 64, 2]`` panel view of a ``pack_bf16`` weight (its storage beyond ``[N, K]``)."""
    n, k = packed.shape
    p = -(-n // PACK_ROWS)
    return packed.as_strided((p, k // 2, PACK_ROWS, 2), (k * PACK_ROWS, 2 * PACK_ROWS, 2, 1))


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 ``weight [N, K]`` (K even) re-laid out for ``linear_bf16_packed``: panels of 64 rows, each
    ``[K / 2][64][2]`` (every row's pair of K elements, for each pair in K order), the last panel zero-padded.

    Returns a new bf16 tensor of shape ``[N, K]`` whose storage holds the ``ceil(N / 64)`` panels
    (``ceil(N / 64) * 64 * K`` elements from its start): only ``linear_bf16_packed``, ``unpack_bf16`` and
    ``packed_rows`` read it; its elements are not the weight's. Layout of oneDNN's bf16 "VNNI" blocked
    weights (pairs along K in a 32-bit lane), here 64 columns wide.

    Raises:
        ValueError: ``weight`` is not 2-D bf16 or K is odd.
    """
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.shape[1] % 2:
        raise ValueError(f"pack_bf16: need a 2-D bf16 weight with even K, got {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    p = -(-n // PACK_ROWS)
    buf = torch.zeros(p * PACK_ROWS * k, dtype=torch.bfloat16)
    packed = buf[: n * k].view(n, k)
    panels = _panels(packed)
    full = n // PACK_ROWS
    if full:
        panels[:full].copy_(weight[: full * PACK_ROWS].view(full, PACK_ROWS, k // 2, 2).transpose(1, 2))
    if n > full * PACK_ROWS:
        panels[full, :, : n - full * PACK_ROWS].copy_(weight[full * PACK_ROWS:].view(-1, k // 2, 2).transpose(0, 1))
    return packed


def unpack_bf16(packed: torch.Tensor) -> torch.Tensor:
    """The ``[N, K]`` bf16 weight that ``pack_bf16`` packed (a new contiguous tensor, bit for bit)."""
    n, k = packed.shape
    return _panels(packed).transpose(1, 2).reshape(-1, k)[:n].contiguous()


def packed_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids [T]`` (int64) of the weight that ``pack_bf16`` packed -> ``[T, K]`` bf16: an embedding
    lookup in a tied LM head's packed table (``F.embedding``'s values, bit for bit)."""
    k = packed.shape[1]
    ids = ids.reshape(-1)
    return _panels(packed)[ids // PACK_ROWS, :, ids % PACK_ROWS].reshape(ids.shape[0], k)


def linear_bf16_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W[N, K].T (+ bias [N])`` -> ``[M, N]``, all bf16, with ``packed = pack_bf16(W)``.

    avx512_bf16 (csrc/linear_bf16_packed.cpp): 16 rows x one K pair per ``vdpbf16ps``; avx2
    (csrc/avx2/linear_bf16_packed.cpp): 8 rows x one K pair widened to fp32, two FMAs. Either way each
    (token, row) value is one fp32 chain over K in order, + bias, rounded to bf16 once: the same bits for
    any M (batch invariance), ``F.linear`` in fp32 up to the summation order and rounding (the two
    variants' bits differ: ``vdpbf16ps`` and FMA round differently).

    Raises:
        RuntimeError: wrong dtypes or shapes, or ``packed`` not from ``pack_bf16`` (raised by the kernel).
    """
    return load_extension().linear_bf16_packed(x, packed, bias)


def linear_int8(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [M, K] bf16 @ (qweight [N, K] int8 * scale [N, 1] fp32).T (+ bias)`` -> ``[M, N]`` bf16.

    Per-output-channel symmetric int8 (``tandem.models.quant``); any K. avx512_bf16: exact
    products, fp32 accumulation. avx2: activations quantized to int8 per block of 32 along K (the
    last block may be partial) and exact integer dot products, each block scaled by its ``dx``, the
    row by ``scale``: within the activation bound (module docstring), plus fp32 rounding and the
    output's bf16 rounding.

    Raises:
        RuntimeError: wrong dtypes or shapes (raised by the kernel).
    """
    return load_extension().linear_int8(x, qweight, scale, bias)


def linear_int4(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [M, K] bf16 @ dequant(qweight [N, K/2] uint8, scale [N, K/32] fp16).T (+ bias)`` -> ``[M, N]``.

    Group-wise (32) symmetric int4 in llama.cpp Q4_0's nibble layout (``tandem.models.quant``).
    avx2: activations quantized per block of 32 (ggml-quants.c ``ggml_vec_dot_q4_0_q8_0``): error
    bound: the activation bound (module docstring), plus fp32 rounding and the output's bf16 rounding.

    Raises:
        RuntimeError: K is not a multiple of 32, or wrong dtypes/shapes (raised by the kernel).
    """
    return load_extension().linear_int4(x, qweight, scale, bias)


def moe_bf16(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Fused mixture-of-experts SwiGLU feed-forward: ``x [T, H]`` bf16 -> ``[T, H]`` bf16.

    ``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]`` bf16, contiguous; ``ids [T, k]``
    int64 expert ids and ``weights [T, k]`` float32 router weights (``models.moe.route``). Out row t is
    ``sum_j weights[t, j] * (bf16(silu(x_t . gate) * (x_t . up)) @ w2[ids[t, j]].T)``, summed in float32
    in slot order ``j`` and rounded to bf16 once. Assignments are grouped by expert in C++, each
    selected expert's weights read once per call for all its tokens, unselected experts never read,
    one OpenMP team per pass. Each dot product has one fixed fp32 summation order, so a token's output
    does not depend on the other tokens of the call (batch invariance). Matches
    ``models.moe.moe_reference`` up to fp32 summation order and bf16 roundings.

    Raises:
        RuntimeError: wrong dtypes or shapes, an expert id outside ``[0, E)`` (raised by the kernel).
    """
    return _routed("moe_bf16")(x, w13, w2, weights, ids)


def moe_int8(
    x: torch.Tensor, w13_q: torch.Tensor, w13_s: torch.Tensor, w2_q: torch.Tensor, w2_s: torch.Tensor,
    weights: torch.Tensor, ids: torch.Tensor,
) -> torch.Tensor:
    """``moe_bf16`` with int8 experts (``models.quant.quantize_int8`` per expert): ``w13_q [E, 2I, H]`` /
    ``w2_q [E, H, I]`` int8 codes, ``w13_s [E, 2I]`` / ``w2_s [E, H]`` fp32 row scales, all contiguous.

    ``x [T, H]`` bf16 -> ``[T, H]`` bf16; each expert's weight is ``q * scale[row]``. The routed tokens and
    the intermediate ``bf16(silu(gate) * up)`` are quantized to int8 per block of 32 and dotted with the
    codes as ``linear_int8`` does (error bound there), grouped by expert: each selected expert's codes are
    read once per call, unselected experts never; batch invariant.

    Raises:
        RuntimeError: wrong dtypes or shapes, an expert id outside ``[0, E)`` (raised by the kernel).
    """
    return _routed("moe_int8")(x, w13_q, w13_s, w2_q, w2_s, weights, ids)


def moe_q8_0(
    x: torch.Tensor, w13_q: torch.Tensor, w13_s: torch.Tensor, w2_q: torch.Tensor, w2_s: torch.Tensor,
    weights: torch.Tensor, ids: torch.Tensor,
) -> torch.Tensor:
    """``moe_int8`` with a GGUF's Q8_0 experts: ``w13_q [E, 2I, H]`` / ``w2_q [E, H, I]`` int8 codes,
    ``w13_s [E, 2I, H/32]`` / ``w2_s [E, H, I/32]`` fp16 group scales; H and I multiples of 32. Arithmetic
    as ``linear_q8_0``.

    Raises:
        RuntimeError: wrong dtypes or shapes, an expert id outside ``[0, E)`` (raised by the kernel).
    """
    return _routed("moe_q8_0")(x, w13_q, w13_s, w2_q, w2_s, weights, ids)


def moe_int4(
    x: torch.Tensor, w13_q: torch.Tensor, w13_s: torch.Tensor, w2_q: torch.Tensor, w2_s: torch.Tensor,
    weights: torch.Tensor, ids: torch.Tensor,
) -> torch.Tensor:
    """``moe_int8`` with Q4_0 experts (``models.quant.quantize_int4`` per expert): ``w13_q [E, 2I, H/2]`` /
    ``w2_q [E, H, I/2]`` uint8 nibbles, ``w13_s [E, 2I, H/32]`` / ``w2_s [E, H, I/32]`` fp16 group scales;
    H and I multiples of 32. Arithmetic as ``linear_int4``.

    Raises:
        RuntimeError: wrong dtypes or shapes, an expert id outside ``[0, E)`` (raised by the kernel).
    """
    return _routed("moe_int4")(x, w13_q, w13_s, w2_q, w2_s, weights, ids)


def moe_kquant(
    x: torch.Tensor, w13_q: torch.Tensor, w13_s: torch.Tensor, w2_q: torch.Tensor, w2_s: torch.Tensor,
    weights: torch.Tensor, ids: torch.Tensor, w13_format: str, w2_format: str,
) -> torch.Tensor:
    """``moe_int8`` with a GGUF's Q4_K / Q6_K experts, as stored (``models.gguf_blocks``: a block's bytes but
    its fp16 fields, and those fields): ``w13_format`` / ``w2_format`` ``"q4_k"`` (codes ``[E, N, K/256 * 140]``
    uint8, scales ``[E, N, K/256, 2]`` fp16 (d, dmin)) or ``"q6_k"`` (``[E, N, K/256 * 208]``, ``[E, N, K/256]``),
    N x K per expert ``2I x H`` for w13 and ``H x I`` for w2; H and I multiples of 256. Arithmetic as
    ``linear_q4_k`` / ``linear_q6_k`` (activations quantized per token and block of 256, llama.cpp's q8_K).

    Raises:
        RuntimeError: an unknown format, wrong dtypes or shapes, an expert id outside ``[0, E)`` (the kernel).
    """
    return _routed("moe_kquant")(x, w13_q, w13_s, w2_q, w2_s, weights, ids, w13_format, w2_format)


def dequantize(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The bf16 weight ``[N, K]`` (``bf16(q * scale)``) of an int8 or int4 layer (formats as above).

    Raises:
        RuntimeError: wrong dtypes or shapes (raised by the kernel).
    """
    return load_extension().dequantize(qweight, scale)


def paged_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Paged causal attention read from the cache in place (online softmax); bf16 or fp32.

    Writes ``k, v [T, KV, D]`` into ``k_cache, v_cache [N, B, KV, D]`` at ``slot_mapping [T]``
    (int64), then fills ``out [T, H, D]`` for every row whose query count is in
    ``1 .. max_query_len``; other rows of ``out`` are left for the caller. ``block_tables [R, M]``,
    ``seq_lens [R]``, ``query_start_loc [R + 1]`` are int32 (``AttentionMetadata``). ``q``, ``k``,
    ``v``, ``out`` need contiguous heads but may have any token stride. ``head_dim`` <= 256.
    ``window`` > 0: a query at position p sees keys ``p - window + 1 .. p`` only (blocks wholly
    before that are not read); ``softcap`` > 0: each scaled score s becomes ``softcap * tanh(s / softcap)``
    (Gemma 2). Both need ``supports_window_softcap()``.

    Raises:
        ValueError: ``window`` or ``softcap`` on a variant without them.
        RuntimeError: mismatched dtypes, shapes or layouts (raised by the kernel).
    """
    module = load_extension()
    if window or softcap:
        if not hasattr(module, "paged_attention_ex"):
            raise ValueError(f"the {backend()} paged_attention kernel has no sliding window or soft-capping")
        module.paged_attention_ex(out, q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                                  query_start_loc, scale, max_query_len, window, softcap)
        return
    module.paged_attention(
        out, q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale, max_query_len
    )


def supports_window_softcap() -> bool:
    """Whether the loaded variant's ``paged_attention`` takes ``window`` and ``softcap`` (avx2 does;
    avx512_bf16 not yet: callers attend such layers with PyTorch ops there)."""
    return available("paged_attention_ex")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over the last dim of ``x [R, dim]``.

    Rounds where transformers' ``LlamaRMSNorm`` rounds (bf16 before the weight multiply).
    """
    return load_extension().rms_norm(x, weight, eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: ``x * cos + rotate_half(x) * sin`` for ``x [T, H, D]``, ``cos, sin [T, 1, D]``.

    Returns a new contiguous tensor; ``x`` may be a strided view (heads contiguous).
    """
    return load_extension().rotary(x, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` for ``x [R, 2d]`` -> ``[R, d]``."""
    return load_extension().silu_and_mul(x)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``torch.max(x, dim=-1).indices`` of ``x [R, V]`` bf16 / float32 with contiguous rows -> ``[R]`` int64: the
    first index of each row's maximum, or of its first NaN (the avx2 build's kernel, routed there from
    avx512_bf16; callers check ``registry.use("argmax")``)."""
    return _routed("argmax")(x)


__all__ += ["dequantize_q4_1", "dequantize_q8_0", "linear_q4_1", "linear_q8_0"]


def linear_q8_0(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [M, K] bf16 @ (qweight [N, K] int8 * scale [N, K/32] fp16 per group of 32).T (+ bias)`` -> ``[M, N]``.

    llama.cpp's Q8_0 blocks (ggml-quants.c ``dequantize_row_q8_0``) split into codes and scales.
    At one token (M = 1) on a CPU with AVX512-VNNI the activations are quantized too, as llama.cpp
    does (``quantize_row_q8_0`` + ``ggml_vec_dot_q8_0_q8_0``): per block of 32, ``dx = max|x| / 127``,
    ``xq = round(x / dx)``, exact integer dot products with the codes, one fp32 multiply by ``d * dx``
    per block. So an output differs from ``x @ dequant(w).T`` by at most ``sum_b dx_b / 2 * sum_j |w_bj|``
    (block b of x and of the weight row; ``dx_b / 2 = max|x_b| / 254``) plus fp32 rounding.
    ``TANDEM_Q8_0_EXACT=1`` (read on every call) gives exact products in fp32 instead; M > 1 multiplies
    x by the weights rounded to bf16, ``bf16(q * d)``. The avx2 variant quantizes the activations the
    same way at every M (``ggml_vec_dot_q8_0_q8_0``'s AVX2 path: ``_mm256_maddubs_epi16`` of ``|q|``
    with ``sign(xq, q)``), so the same bound holds for every token, batch invariant, and ignores
    ``TANDEM_Q8_0_EXACT``.

    Raises:
        RuntimeError: K is not a multiple of 32, or wrong dtypes/shapes (raised by the kernel).
    """
    return load_extension().linear_q8_0(x, qweight, scale, bias)


def linear_q4_1(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [M, K] bf16 @ (u * d + m).T (+ bias)`` -> ``[M, N]`` bf16, u the nibbles of ``qweight``.

    ``qweight [N, K/2]`` uint8 in Q4_0's nibble layout (u in 0..15, no offset), ``scale [N, K/32, 2]``
    fp16 pairs (d, m): llama.cpp's Q4_1 blocks (ggml-quants.c ``dequantize_row_q4_1``). avx2:
    activations quantized per block of 32 (``ggml_vec_dot_q4_1_q8_1``: ``d * dx * sum u xq`` plus
    ``m * dx * sum xq``): within the activation bound (module docstring, ``w = u d + m``), plus fp32
    rounding and the output's bf16 rounding.

    Raises:
        RuntimeError: K is not a multiple of 32, or wrong dtypes/shapes (raised by the kernel).
    """
    return load_extension().linear_q4_1(x, qweight, scale, bias)


def dequantize_q8_0(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The bf16 weight ``[N, K]`` (``bf16(q * scale)``) of a q8_0 layer (format as in ``linear_q8_0``)."""
    return load_extension().dequantize_q8_0(qweight, scale)


def dequantize_q4_1(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The bf16 weight ``[N, K]`` (``bf16(u * d + m)``) of a q4_1 layer (format as in ``linear_q4_1``)."""
    return load_extension().dequantize_q4_1(qweight, scale)


__all__ += ["linear_q4_k", "linear_q5_0", "linear_q6_k"]


def _routed(op: str):  # noqa: ANN202
    """``op`` of the variant the kernel registry runs it on: the loaded variant's, or the one it routes to
    (the avx2 build, for the GGUF Q5_0 / K-quant linears and the MoE kernels on an ``avx512_bf16`` CPU).

    Raises:
        AttributeError: the operator runs on no compiled variant here (callers ask ``registry.use`` first).
    """
    from tandem.kernels import build, registry

    backend = registry.backend_for(op)
    if backend == "torch":
        raise AttributeError(f"no compiled kernel runs {op} here (backend {build.selected_variant() or 'torch'})")
    return getattr(build.load_variant(backend), op)


def linear_q5_0(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [M, K] bf16 @ dequant(qweight, scale).T (+ bias)`` -> ``[M, N]`` bf16: GGUF Q5_0 blocks.

    ``qweight [N, K/32 * 20]`` uint8 (per block: 4 bytes of 5th bits, 16 bytes of nibbles), ``scale [N, K/32]``
    fp16 (``tandem/models/gguf_blocks.py``). avx2 only (``avx512_bf16`` routes it there): activations quantized
    per block of 32 (``ggml_vec_dot_q5_0_q8_0``): within the activation bound (module docstring), plus fp32
    rounding and the output's bf16 rounding. Any M, batch invariant.

    Raises:
        RuntimeError: wrong dtypes or shapes (raised by the kernel).
    """
    return _routed("linear_q5_0")(x, qweight, scale, bias)


def linear_q4_k(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [M, K] bf16 @ dequant(qweight, scale).T (+ bias)`` -> ``[M, N]`` bf16: GGUF Q4_K super-blocks.

    ``qweight [N, K/256 * 140]`` uint8 (12 bytes of 6-bit scales and mins, 128 bytes of nibbles),
    ``scale [N, K/256, 2]`` fp16 (d, dmin) (``tandem/models/gguf_blocks.py``). avx2 only: activations
    quantized per token and block of 256 as llama.cpp's q8_K (``ggml_vec_dot_q4_K_q8_K``): ``dy ~ max|x_B| /
    127``, so within ``sum_B max|x_B| / 254 * sum_{j in B} |w_j|`` plus fp32 rounding and bf16 output rounding.
    Any M, batch invariant.

    Raises:
        RuntimeError: x's K is not the weight's (``qweight`` rows hold whole blocks of 256), or wrong
            dtypes/shapes (raised by the kernel).
    """
    return _routed("linear_q4_k")(x, qweight, scale, bias)


def linear_q6_k(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [M, K] bf16 @ dequant(qweight, scale).T (+ bias)`` -> ``[M, N]`` bf16: GGUF Q6_K super-blocks.

    ``qweight [N, K/256 * 208]`` uint8 (ql[128], qh[64], 16 int8 scales), ``scale [N, K/256]`` fp16 (d). avx2
    only: q8_K activations as ``linear_q4_k`` (``ggml_vec_dot_q6_K_q8_K``), the same bound. Any M, batch
    invariant.

    Raises:
        RuntimeError: x's K is not the weight's, or wrong dtypes/shapes (raised by the kernel).
    """
    return _routed("linear_q6_k")(x, qweight, scale, bias)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In-place ``rotary``: ``x [T, H, D]`` (heads contiguous, any token stride) with ``cos, sin [T, 1, D]``.

    Meant for the q and k columns of a fused qkv output viewed as ``[T, H + KV, D]``: one call, no copy.

    Raises:
        RuntimeError: mismatched dtypes or a layout other than contiguous heads (raised by the kernel).
    """
    load_extension().rotary_(x, cos, sin)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: ``residual = residual + x``, then ``x = rms_norm(residual, weight, eps)``; ``x, residual [R, dim]``.

    vLLM's ``fused_add_rms_norm``: the residual add of a pre-norm block and the next RMSNorm in one
    pass, rounding where ``residual + x`` followed by ``rms_norm`` round (bf16 after the add).

    Raises:
        RuntimeError: non-contiguous tensors, mismatched shapes or dtypes (raised by the kernel).
    """
    load_extension().fused_add_rms_norm(x, residual, weight, eps)


# The formats a linear of ``decoder_layer`` may have, in the C++ kernel's numbering (csrc/decoder_layer.cpp);
# the GGUF K-quants (q5_0, q4_k, q6_k) only in the avx2 build, like their linear kernels.
LINEAR_KINDS = ("bf16", "int8", "int4", "q8_0", "q4_1", "q5_0", "q4_k", "q6_k", "bf16_packed")
LayerLinear = tuple[str, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"]


class FlatLinears(NamedTuple):
    """A layer's linears as the extension takes them (``flatten_linears``): per part its ``LINEAR_KINDS`` index,
    weight, scale and bias, and per linear (qkv, o, gate_up, down) its number of parts."""

    kinds: list[int]
    weights: list[torch.Tensor]
    scales: list[torch.Tensor | None]
    biases: list[torch.Tensor | None]
    groups: list[int]


def flatten_linears(linears: tuple[LayerLinear | list[LayerLinear], ...]) -> FlatLinears:
    """``decoder_layer``'s ``linears`` as ``FlatLinears`` (done once per layer by ``models.fused_plan``).

    Raises:
        ValueError: an unknown format.
    """
    parts = [linear if isinstance(linear, list) else [linear] for linear in linears]
    flat = [part for group in parts for part in group]
    return FlatLinears([LINEAR_KINDS.index(fmt) for fmt, _, _, _ in flat], [w for _, w, _, _ in flat],
                       [s for _, _, s, _ in flat], [b for _, _, _, b in flat], [len(group) for group in parts])


def decoder_layer(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    input_norm: torch.Tensor,
    post_norm: torch.Tensor,
    eps: float,
    linears: tuple[LayerLinear | list[LayerLinear], ...] | FlatLinears,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: object,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    max_query_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole pre-norm decoder layer (Llama / Mistral / Qwen2) in one call: ``(mlp_out, residual)``.

    Runs the kernels of ``LlamaDecoderLayer.forward``'s kernel path in the same order, so the result
    is bit-identical to it: ``x [T, hidden]`` bf16 and ``residual`` (None on the first layer: ``x`` is
    then the embeddings) as there; norm weights ``[hidden]``; ``linears`` = qkv (rows ordered q, k, v),
    o, gate_up, down, each ``(format, weight, scale, bias)``: ``"bf16"`` with the weight ``[N, K]`` and no
    scale, ``"bf16_packed"`` with a ``pack_bf16`` weight and no scale, or a ``QuantizedLinear``
    format of ``LINEAR_KINDS`` with its ``qweight`` and ``scale``
    (``Linear.kernel_linear`` / ``QuantizedLinear.kernel_linear``), or a list of such parts whose outputs are
    concatenated along N (``ConcatLinear.kernel_linear``); or all four already flattened (``FlatLinears``);
    ``cos, sin [T, 1, head_dim]``; caches ``[N, B, KV, D]``; ``meta`` an ``AttentionMetadata``. Requires
    ``T <= max_query_len`` and the registry's limits (``registry.use("decoder_layer", tokens=T)`` and each
    linear's own op).

    Changes: overwrites ``x`` and ``residual`` in place; writes this step's K/V into the caches.

    Raises:
        ValueError: an unknown format. RuntimeError: wrong dtypes, shapes or layouts (raised by the kernels).
    """
    flat = linears if isinstance(linears, FlatLinears) else flatten_linears(linears)
    return load_extension().decoder_layer(
        x, residual, input_norm, post_norm, eps, flat.kinds, flat.weights, flat.scales, flat.biases, flat.groups,
        cos, sin, k_cache, v_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        num_heads, num_kv_heads, scale, max_query_len,
    )
