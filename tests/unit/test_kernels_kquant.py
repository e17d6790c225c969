"""GGUF Q5_0 / Q4_K / Q6_K: the avx2 linears and the torch dequantizers against gguf-py's (an independent reference).

Layers are random GGUF blocks (random code bytes, fp16 fields in a sane range). The reference weight is
``gguf.quants.dequantize`` of the blocks (gguf-py's numpy port of ggml-quants.c), as float64.
Bounds (why each tolerance is what it is):
  float64      vs ``x @ w.T + b``: the output's bf16 rounding (2^-8 relative), fp32 rounding of the block terms
               (a chain of at most K/8 + 5 roundings of ``|x| @ |terms|.T``; for q4_k the terms are ``d sc u`` and
               ``dmin m``, whose magnitudes can exceed ``|w|``), plus quantizing the activations to int8 per block
               (32 values for q5_0 as q8_0, 256 for q4_k / q6_k as llama.cpp's q8_K): each x moves by at most
               ``max|x_blk| / 254`` (times 1 + 2^-7 for the bf16 rounding of that error), i.e.
               ``sum_blk max|x_blk| / 254 * sum_{j in blk} |w_j|``.
  emulated     vs the float64 value of llama.cpp's arithmetic on the quantized activations (integer sums
               per block from gguf-py's dequantizer with unit fp16 fields): fp32 rounding of the block terms
               (a chain of one FMA per block into a lane, two for q4_k, plus a few conversions and products:
               ``chain * 2^-24`` of their magnitudes) and the bf16 output rounding.
  dequantize   the torch dequantizers equal gguf-py's bit for bit.
  invariance   a token's outputs are bit-identical at M = 1 and inside batches of 2 .. 300.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tandem.kernels import build
from tandem.models import gguf_blocks, quant

pytestmark = pytest.mark.skipif(build.load_variant("avx2") is None, reason="the avx2 kernels do not run here")

QTYPES = {"q5_0": Q.Q5_0, "q4_k": Q.Q4_K, "q6_k": Q.Q6_K}
FORMATS = tuple(QTYPES)


def kernel(fmt: str):  # noqa: ANN201
    return getattr(build.load_variant("avx2"), f"linear_{fmt}")


def random_blocks(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 ``[n, k / values, nbytes]``: random code bytes, fp16 fields uniform in [1e-3, 1e-2) (positive)."""
    layout = gguf_blocks.LAYOUTS[fmt]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // layout.values, layout.nbytes), dtype=np.uint8)
    fields = rng.uniform(1e-3, 1e-2, (n, k // layout.values, layout.scale_halves)).astype(np.float16)
    blocks[..., slice(*layout.scale)] = fields.view(np.uint8).reshape(n, k // layout.values, -1)
    return blocks


def split(fmt: str, blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight, scale) of ``blocks`` as QuantizedLinear holds them (the layouts of gguf_blocks)."""
    layout = gguf_blocks.LAYOUTS[fmt]
    n, nb, _ = blocks.shape
    shapes = gguf_blocks.block_shapes(fmt, n, nb * layout.values)
    scale = blocks[..., slice(*layout.scale)].copy().view(np.float16).reshape(shapes["scale"][0])
    codes = blocks[..., slice(*layout.codes)].copy().reshape(shapes["qweight"][0])
    return torch.from_numpy(codes), torch.from_numpy(scale)


def reference(fmt: str, blocks: np.ndarray) -> torch.Tensor:
    """float64 ``[n, k]`` weights by gguf-py."""
    n = blocks.shape[0]
    return torch.from_numpy(gguf.quants.dequantize(blocks.reshape(n, -1), QTYPES[fmt]).reshape(n, -1)).double()


def with_fields(fmt: str, blocks: np.ndarray, *values: float) -> torch.Tensor:
    """gguf-py's weights of ``blocks`` with their fp16 field(s) replaced by ``values`` (e.g. d = 1: the codes
    times their integer sub-block scales, exact in float32)."""
    layout = gguf_blocks.LAYOUTS[fmt]
    patched = blocks.copy()
    patched[..., slice(*layout.scale)] = np.array(values, dtype=np.float16).view(np.uint8)
    return reference(fmt, patched)


def term_magnitudes(fmt: str, blocks: np.ndarray) -> torch.Tensor:
    """``[n, k]``: ``|d sc u| + |dmin m|`` for q4_k (dmin's sign flipped: both terms positive), else ``|w|``."""
    if fmt != "q4_k":
        return reference(fmt, blocks).abs()
    flipped = blocks.copy()
    flipped[..., 3] ^= 0x80  # the sign bit of dmin (bytes 2-3, little-endian)
    return reference(fmt, flipped).abs()


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    """bf16 ``[m, k]`` with outliers and, when k > 256, a zero block of 256 (a zero q8_K block)."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, 7::97] *= 40.0
    if k > 256:
        x[:, 256:512] = 0.0
    return x.bfloat16()


def blocked(t: torch.Tensor, size: int) -> torch.Tensor:
    return t.reshape(t.shape[0], -1, size)


def activation_bound(fmt: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    size = gguf_blocks.LAYOUTS[fmt].values
    amax = blocked(x.double().abs(), size).amax(dim=2)
    return (amax / 254) @ blocked(w.abs(), size).sum(dim=2).T


SHAPES = {  # (M, N, K): N with whole tiles and leftover rows, M 1 .. 300
    "q5_0": [(1, 5, 32), (1, 67, 96), (2, 64, 576), (5, 33, 1056), (16, 129, 2080), (300, 9, 64)],
    "k": [(1, 5, 256), (1, 67, 512), (2, 64, 768), (5, 33, 1536), (16, 41, 2048), (300, 9, 256)],
}


def shapes(fmt: str) -> list[tuple[int, int, int]]:
    return SHAPES["q5_0" if fmt == "q5_0" else "k"]


@pytest.mark.parametrize(("fmt", "m", "n", "k"), [(f, *s) for f in FORMATS for s in shapes(f)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_float64_reference(fmt: str, m: int, n: int, k: int, bias: bool) -> None:
    blocks = random_blocks(fmt, n, k, seed=m * 1000 + n + k)
    w = reference(fmt, blocks)
    x = activations(m, k, seed=n + k)
    b = torch.randn(n, generator=torch.Generator().manual_seed(m)).bfloat16() if bias else None
    y = kernel(fmt)(x, *split(fmt, blocks), b)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    bias64 = torch.zeros(n, dtype=torch.float64) if b is None else b.double()
    ref = x.double() @ w.T + bias64
    mag = x.double().abs() @ term_magnitudes(fmt, blocks).T + bias64.abs()
    bound = 2**-8 * ref.abs() + (k / 8 + 5) * 2**-24 * mag + activation_bound(fmt, x, w) * (1 + 2**-7) + 1e-30
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), (err / bound).max()


def q8_activations(fmt: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``xq [M, B, size]`` float64 integers, ``dx [M, B]`` float64 of fp32): ggml's quantize_row_q8_0 (q5_0:
    ``dx = amax / 127``, ``xq = round(x * (1 / dx))``) or quantize_row_q8_K (``iscale = 127 / amax``,
    ``xq = round(x * iscale)``, ``dx = 1 / iscale``), in fp32, round half to even."""
    size = gguf_blocks.LAYOUTS[fmt].values
    xb = blocked(x.float(), size)
    amax = xb.abs().amax(dim=2)
    zero = amax == 0
    if fmt == "q5_0":
        dx = amax / 127
        inv = torch.where(zero, torch.zeros_like(dx), 1 / dx)
    else:
        inv = torch.where(zero, torch.zeros_like(amax), 127 / amax)
        dx = torch.where(zero, torch.zeros_like(amax), 1 / inv)
    return torch.round(xb * inv[..., None]).double(), dx.double()


@pytest.mark.parametrize(("fmt", "m", "n", "k"), [(f, *s) for f in FORMATS for s in shapes(f)[:4]])
def test_linear_is_llama_cpp_arithmetic(fmt: str, m: int, n: int, k: int) -> None:
    """``y = sum_blk dx (d I - dmin I_m)`` with exact integer sums I (codes times their integer sub-block
    scales, from gguf-py with d = 1) and I_m (q4_k's mins), evaluated in float64."""
    blocks = random_blocks(fmt, n, k, seed=m + n + k)
    x = activations(m, k, seed=m * 7 + k)
    y = kernel(fmt)(x, *split(fmt, blocks)).double()
    size = gguf_blocks.LAYOUTS[fmt].values
    xq, dx = q8_activations(fmt, x)
    _, scale = split(fmt, blocks)
    s = scale.double().reshape(n, k // size, -1)
    codes = with_fields(fmt, blocks, 1.0, 0.0) if fmt == "q4_k" else with_fields(fmt, blocks, 1.0)
    dots = torch.einsum("mbj,nbj->mnb", xq, blocked(codes, size))  # exact integers
    terms = s[None, :, :, 0] * dx[:, None] * dots
    emulated, magnitude = terms.sum(2), terms.abs().sum(2)
    if fmt == "q4_k":
        mins = torch.einsum("mbj,nbj->mnb", xq, blocked(-with_fields(fmt, blocks, 0.0, 1.0), size))
        min_terms = s[None, :, :, 1] * dx[:, None] * mins
        emulated, magnitude = emulated - min_terms.sum(2), magnitude + min_terms.abs().sum(2)
    chain = (2 if fmt == "q4_k" else 1) * k / size + 8  # FMAs into one lane, conversions, products, hsum
    bound = 2**-8 * emulated.abs() + chain * 2**-24 * magnitude + 1e-30
    assert ((y - emulated).abs() <= bound).all()


@pytest.mark.parametrize(("fmt", "k"), [("q5_0", 96), ("q5_0", 1056), ("q4_k", 512), ("q6_k", 512)])
def test_linear_is_batch_invariant(fmt: str, k: int) -> None:
    """Each token's outputs are bit-identical alone and in batches of every size, wherever it sits (q5_0: blocks
    in pairs, then an odd last block; 1056 = 33 blocks: pairs in five groups of 8)."""
    blocks = random_blocks(fmt, 45, k, seed=7)  # 45 rows: whole tiles of 4 and 2 and leftover rows
    tensors = split(fmt, blocks)
    x = activations(300, k, seed=8)
    b = torch.randn(45, generator=torch.Generator().manual_seed(9)).bfloat16()
    fn = kernel(fmt)
    alone = torch.cat([fn(x[i : i + 1], *tensors, b) for i in range(300)])
    for m in (2, 3, 5, 8, 17, 64, 300):
        for start in {0, 300 - m, (300 - m) // 2}:
            assert torch.equal(fn(x[start : start + m], *tensors, b), alone[start : start + m]), (m, start)


@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_dequantizers_equal_gguf_py(fmt: str) -> None:
    blocks = random_blocks(fmt, 13, 512, seed=3)
    ours = quant.dequantize_weight(fmt, *split(fmt, blocks))
    assert ours.dtype == torch.float32 and torch.equal(ours.double(), reference(fmt, blocks))


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_buffer_rows_and_strided_inputs_give_the_same_bits(fmt: str) -> None:
    """Rows inside QuantizedLinear.empty's single buffer (scales then codes, strided) and a strided x."""
    blocks = random_blocks(fmt, 20, 512, seed=11)
    qweight, scale = split(fmt, blocks)
    layer = quant.QuantizedLinear.empty(fmt, 512, [20], False, torch.bfloat16)
    layer.qweight.copy_(qweight)
    layer.scale.copy_(scale)
    assert layer.qweight.stride(0) > layer.qweight.shape[1]
    x = activations(3, 512, seed=12)
    strided = torch.cat([x, x], dim=1)[:, :512]
    assert torch.equal(kernel(fmt)(strided, layer.qweight, layer.scale), kernel(fmt)(x, qweight, scale))


def test_bad_arguments_raise() -> None:
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="disagree on K"):
        kernel("q4_k")(x, torch.zeros(3, 280, dtype=torch.uint8), torch.zeros(3, 2, 2, dtype=torch.float16))
    with pytest.raises(RuntimeError, match=r"scale must be fp16 \[N, blocks, 2\]"):
        kernel("q4_k")(x, torch.zeros(3, 140, dtype=torch.uint8), torch.zeros(3, 1, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="qweight must be uint8"):
        kernel("q6_k")(x, torch.zeros(3, 200, dtype=torch.uint8), torch.zeros(3, 1, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="x must be 2-D bf16"):
        kernel("q5_0")(x.float(), torch.zeros(3, 160, dtype=torch.uint8), torch.zeros(3, 8, dtype=torch.float16))
