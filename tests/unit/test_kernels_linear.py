"""The linear kernels of every compiled variant this CPU runs, against independent float64 references.

Each test calls ``build.load_variant(v).<fn>`` directly for every ``v`` in ``VARIANTS`` (avx2 on every
x86-64 machine, avx512_bf16 too where the CPU has it). Bounds (why each tolerance is what it is):
  bf16         vs float64 ``x @ w.T + b`` of the same bf16 values: products are exact in fp32, so the
               error is fp32 accumulation (a chain of at most K/8 + 4 roundings: ``(K/8 + 5) 2^-24``
               of ``|x| @ |w|.T + |b|``) plus the output's bf16 rounding (2^-8 relative).
  quantized    vs float64 ``x @ dequant(w).T + b``: the output's bf16 rounding and fp32 rounding of the
               block terms as above, plus where activations are quantized to int8 per block of 32
               (avx2 always; avx512_bf16 for q8_0 unless TANDEM_Q8_0_EXACT=1) ``activation_bound``;
               avx512_bf16's int4 / q4_1 sums of x (one per block, fp32) and their cancellation
               against the 128 + u codes, 2^-9 of ``|x| @ |w|.T``.
  quantized    avx2 vs the float64 value of llama.cpp's arithmetic on the quantized activations
               (``quantized_reference``): only fp32 rounding of the block terms and bf16 output rounding.
  dequantize*  equal to the Python dequantization rounded to bf16, bit for bit.
  invariance   every variant: a token's outputs are bit-identical at M = 1 and inside batches of 2 .. 300
               (bf16: every M from 2 to 40, K with and without chunks past the 4-chain loop).
"""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import build
from tandem.models import quant

VARIANTS = [v for v in build.VARIANTS if build.load_variant(v) is not None]
FORMATS = ("bf16", "int8", "int4", "q8_0", "q4_1")
OPS = {"bf16": "linear_bf16", "int8": "linear_int8", "int4": "linear_int4", "q8_0": "linear_q8_0",
       "q4_1": "linear_q4_1"}
DEQUANT_OPS = {"int8": "dequantize", "int4": "dequantize", "q8_0": "dequantize_q8_0", "q4_1": "dequantize_q4_1"}

pytestmark = pytest.mark.skipif(not VARIANTS, reason="no kernel variant runs on this machine")


def kernel(variant: str, fmt: str):
    return getattr(build.load_variant(variant), OPS[fmt])


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def layer(fmt: str, n: int, k: int, g: torch.Generator) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """(kernel tensors, float64 weight [n, k]) of a random ``fmt`` layer; group codes as a GGUF file holds them."""
    if fmt == "bf16":
        w = torch.randn(n, k, generator=g).bfloat16()
        return (w,), w.double()
    if fmt in ("int8", "int4"):
        tensors = (quant.quantize_int8 if fmt == "int8" else quant.quantize_int4)(torch.randn(n, k, generator=g))
    else:
        d = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.001).half()
        if fmt == "q8_0":
            tensors = (torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g), d)
        else:
            mins = (torch.randn(n, k // 32, generator=g) * 0.05).half()
            tensors = (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g), torch.stack([d, mins], 2))
    return tensors, quant.dequantize_weight(fmt, *tensors).double()


def activations(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """bf16 ``[m, k]`` with outliers (a few blocks dominated by one value) and, when k > 64, a zero block."""
    x = torch.randn(m, k, generator=g)
    x[:, 7::97] *= 40.0
    if k > 64:
        x[:, 32:64] = 0.0
    return x.bfloat16()


def padded_blocks(t: torch.Tensor) -> torch.Tensor:
    """``[R, K]`` -> ``[R, ceil(K / 32), 32]``, zero-padded (int8's partial last block)."""
    k = t.shape[1]
    return torch.nn.functional.pad(t, (0, -k % 32)).view(t.shape[0], -1, 32)


def activation_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``[M, N]``: ``sum_b max|x_b| / 254 * sum_j |w_bj|``, the most rounding x to int8 per block changes x @ w.T."""
    amax = padded_blocks(x.double().abs()).amax(dim=2)
    return (amax / 254) @ padded_blocks(w.abs()).sum(dim=2).T


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml-quants.c ``quantize_row_q8_0`` in torch: (``xq [M, B, 32]`` int64, ``dx [M, B]`` fp32).

    Per block: ``dx = max|x_b| / 127``, ``xq = round(x_b * (1 / dx))`` in fp32 (half to even), 0 if dx = 0.
    """
    xb = padded_blocks(x.float())
    dx = xb.abs().amax(dim=2) / 127
    inv = torch.where(dx != 0, 1 / dx, torch.zeros_like(dx))
    return torch.round(xb * inv[..., None]).long(), dx


def quantized_reference(fmt: str, x: torch.Tensor, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """float64 (``y [M, N]``, ``terms [M, N]``) of llama.cpp's arithmetic on quantized activations
    (ggml_vec_dot_q8_0_q8_0 / q4_0_q8_0 / q4_1_q8_1): ``y = sum_b s_b dx_b I_b (+ m_b dx_b S_b)`` with
    the exact integer ``I_b = sum_j c_j xq_j`` of the weight codes c; ``terms`` is the sum of the
    terms' magnitudes, the scale of their fp32 rounding."""
    xq, dx = quantize_activations(x)
    n = tensors[0].shape[0]
    if fmt in ("int4", "q4_1"):
        codes = quant._unpack_nibbles(tensors[0]).long() - (8 if fmt == "int4" else 0)
    else:
        codes = padded_blocks(tensors[0].long())
    dots = torch.einsum("mbj,nbj->mnb", xq, codes).double()  # exact integers
    scale = tensors[1].double()
    d = torch.ones(n, 1, dtype=torch.float64) if fmt == "int8" else (scale[..., 0] if fmt == "q4_1" else scale)
    per_block = d[None] * (dx.double()[:, None] * dots)
    y, terms = per_block.sum(2), per_block.abs().sum(2)
    if fmt == "q4_1":
        mins = scale[..., 1][None] * (dx.double() * xq.sum(2).double())[:, None]
        y, terms = y + mins.sum(2), terms + mins.abs().sum(2)
    if fmt == "int8":
        y, terms = y * scale[None], terms * scale.abs()[None]
    return y, terms


def quantizes_activations(variant: str, fmt: str, m: int) -> bool:
    del m  # every token count computes as one token does (batch invariance)
    return fmt != "bf16" and (variant == "avx2" or (fmt == "q8_0" and "avx512_vnni" in build.cpu_flags()))


SHAPES = {  # (M, N, K): odd and tiny K, K not a multiple of 8 or 32 where the format allows, M 1 .. 300
    "bf16": [(1, 1, 1), (1, 7, 33), (3, 129, 257), (4, 64, 896), (5, 13, 31), (16, 37, 100), (2, 1001, 2048),
             (17, 9, 64), (300, 21, 37)],
    "int8": [(1, 1, 1), (2, 7, 33), (4, 64, 1000), (5, 13, 1031), (16, 37, 2100), (300, 11, 45)],
    "group": [(1, 5, 32), (1, 67, 96), (2, 64, 576), (5, 33, 1056), (16, 129, 2080), (40, 70, 160), (300, 9, 64)],
}


def shapes(fmt: str) -> list[tuple[int, int, int]]:
    return SHAPES.get(fmt, SHAPES["group"])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("fmt", "m", "n", "k"), [(f, *s) for f in FORMATS for s in shapes(f)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_float64_reference(variant: str, fmt: str, m: int, n: int, k: int, bias: bool) -> None:
    g = gen(m * 1000 + n + k)
    tensors, w = layer(fmt, n, k, g)
    x = activations(m, k, g)
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    y = kernel(variant, fmt)(x, *tensors, b)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    bias64 = torch.zeros(n, dtype=torch.float64) if b is None else b.double()
    ref = x.double() @ w.T + bias64
    mag = x.double().abs() @ w.abs().T + bias64.abs()
    bound = 2**-8 * ref.abs() + (k / 8 + 5) * 2**-24 * mag + 1e-30
    if quantizes_activations(variant, fmt, m):
        bound = bound + activation_bound(x, w) * (1 + 2**-7)  # of the activation error itself: its bf16 rounding
    elif fmt != "bf16" and variant != "avx2":
        bound = bound + 2**-9 * mag
    assert ((y.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize(("fmt", "m", "n", "k"), [(f, *s) for f in FORMATS[1:] for s in shapes(f)])
@pytest.mark.parametrize("bias", [False, True])
def test_avx2_quantized_linear_is_llama_cpp_arithmetic(fmt: str, m: int, n: int, k: int, bias: bool) -> None:
    """avx2 equals the quantized-activation formula up to fp32 rounding of the block terms (a chain of
    at most K/256 + 5 roundings, plus one for the product d * dx) and the output's bf16 rounding."""
    if "avx2" not in VARIANTS:
        pytest.skip("the avx2 variant does not run here")
    g = gen(m * 1000 + n + k + 1)
    tensors, _ = layer(fmt, n, k, g)
    x = activations(m, k, g)
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    y = kernel("avx2", fmt)(x, *tensors, b).double()
    emulated, terms = quantized_reference(fmt, x, tensors)
    if b is not None:
        emulated, terms = emulated + b.double(), terms + b.double().abs()
    bound = 2**-8 * emulated.abs() + (k / 256 + 7) * 2**-24 * terms + 1e-30
    assert ((y - emulated).abs() <= bound).all()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k", [200, 224, 1000])
def test_linear_is_batch_invariant(variant: str, fmt: str, bias: bool, k: int) -> None:
    """Each token's outputs are bit-identical alone and in batches of every size, wherever it sits
    (avx512_bf16's bf16 linear: K = 200 and 224 leave chunks past the 4-accumulator loop, 1000 a masked one)."""
    if fmt not in ("bf16", "int8") and k % 32:
        k = 1024  # whole blocks of 32 only
    g = gen(7)
    tensors, _ = layer(fmt, 45, k, g)  # 45 rows: whole tiles and leftover rows
    x = activations(300, k, g)
    b = torch.randn(45, generator=g).bfloat16() if bias else None
    fn = kernel(variant, fmt)
    alone = torch.cat([fn(x[i : i + 1], *tensors, b) for i in range(300)])
    for m in (2, 3, 5, 8, 16, 17, 64, 300):
        for start in {0, 300 - m, (300 - m) // 2}:
            assert torch.equal(fn(x[start : start + m], *tensors, b), alone[start : start + m]), (m, start)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("k", [896, 4864, 130, 2600, 31])
def test_linear_bf16_every_token_count_is_one_token_bits(variant: str, k: int) -> None:
    """bf16, M = 2 .. 40 against M = 1 bit for bit, and M = 1 against float64: Qwen2.5-0.5B's K (896, 4864:
    whole 4-chain groups), K past the 4-chain loop (130: one masked chunk; 2600: two 1024-element blocks
    of avx512_bf16's passes, a partial one, a whole and a masked chunk after), K below one chunk (31);
    21 rows leave one past the 4-row tiles."""
    g = gen(k + 5)
    tensors, w = layer("bf16", 21, k, g)
    x = activations(45, k, g)
    b = torch.randn(21, generator=g).bfloat16()
    fn = kernel(variant, "bf16")
    alone = torch.cat([fn(x[i : i + 1], *tensors, b) for i in range(45)])
    for m in range(2, 41):
        for start in (0, 45 - m):
            assert torch.equal(fn(x[start : start + m], *tensors, b), alone[start : start + m]), (m, start)
    ref = x.double() @ w.T + b.double()
    mag = x.double().abs() @ w.abs().T + b.double().abs()
    bound = 2**-8 * ref.abs() + (k / 8 + 5) * 2**-24 * mag + 1e-30
    assert ((alone.double() - ref).abs() <= bound).all()


@pytest.mark.skipif("avx512_bf16" not in VARIANTS, reason="the avx512_bf16 variant does not run here")
def test_avx512_exact_q8_0_is_batch_invariant_and_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """TANDEM_Q8_0_EXACT=1: fp32 products of the int8 codes (no activation quantization), any M the same bits."""
    monkeypatch.setenv("TANDEM_Q8_0_EXACT", "1")
    g = gen(21)
    tensors, w = layer("q8_0", 37, 544, g)
    x = activations(70, 544, g)
    fn = kernel("avx512_bf16", "q8_0")
    alone = torch.cat([fn(x[i : i + 1], *tensors) for i in range(70)])
    for m in (2, 3, 8, 16, 17, 64, 70):
        assert torch.equal(fn(x[:m], *tensors), alone[:m]), m
    ref = x.double() @ w.T
    mag = x.double().abs() @ w.abs().T
    assert ((alone.double() - ref).abs() <= 2**-8 * ref.abs() + (544 / 8 + 5) * 2**-24 * mag + 1e-30).all()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("fmt", "k"), [("int8", 96), ("int8", 45), ("int4", 96), ("q8_0", 96), ("q4_1", 96)])
def test_dequantize_matches_python(variant: str, fmt: str, k: int) -> None:
    tensors, w = layer(fmt, 13, k, gen(k))
    out = getattr(build.load_variant(variant), DEQUANT_OPS[fmt])(*tensors)
    assert torch.equal(out, w.float().bfloat16())


@pytest.mark.parametrize("variant", VARIANTS)
def test_strided_rows_and_inputs(variant: str) -> None:
    """q8_0 / q4_1 rows inside one buffer (QuantizedLinear.empty's layout) and a strided x give the same bits."""
    g = gen(11)
    x = activations(3, 128, g)
    strided = torch.cat([x, x], dim=1)[:, :128]
    for fmt in ("q8_0", "q4_1"):
        tensors, _ = layer(fmt, 20, 128, g)
        one_buffer = quant.QuantizedLinear.empty(fmt, 128, [20], False, torch.bfloat16)
        one_buffer.qweight.copy_(tensors[0])
        one_buffer.scale.copy_(tensors[1])
        assert one_buffer.qweight.stride(0) > one_buffer.qweight.shape[1]
        expected = kernel(variant, fmt)(x, *tensors)
        assert torch.equal(kernel(variant, fmt)(strided, one_buffer.qweight, one_buffer.scale), expected)
    w = torch.randn(5, 128, generator=g).bfloat16()
    assert torch.equal(kernel(variant, "bf16")(strided, w), kernel(variant, "bf16")(x, w))


@pytest.mark.parametrize("variant", VARIANTS)
def test_bad_arguments_raise(variant: str) -> None:
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    module = build.load_variant(variant)
    with pytest.raises(RuntimeError, match="disagree on K"):
        module.linear_bf16(x, torch.zeros(5, 63, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bf16 only"):
        module.linear_bf16(x.float(), torch.zeros(5, 64))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        module.linear_int4(torch.zeros(2, 40, dtype=torch.bfloat16), torch.zeros(3, 20, dtype=torch.uint8),
                           torch.zeros(3, 1, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        module.linear_q8_0(torch.zeros(2, 40, dtype=torch.bfloat16), torch.zeros(3, 40, dtype=torch.int8),
                           torch.zeros(3, 1, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="fp32"):
        module.linear_int8(x, torch.zeros(3, 64, dtype=torch.int8), torch.zeros(3, dtype=torch.float16))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("m", [1, 4, 16, 40])
def test_linear_bf16_propagates_inf_and_nan_like_f_linear(variant: str, m: int) -> None:
    x = torch.randn(m, 64, generator=gen(3)).bfloat16()
    w = torch.randn(40, 64, generator=gen(4)).bfloat16()
    x[0, 5] = float("inf")  # row 0: +-inf, or NaN where an inf meets a zero weight
    w[7, 5] = 0.0
    x[m - 1, 9] = float("nan") if m > 1 else x[m - 1, 9]
    ref = x.double() @ w.double().T
    y = kernel(variant, "bf16")(x, w).double()
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
    assert torch.equal(y[ref.isinf()], ref[ref.isinf()])
