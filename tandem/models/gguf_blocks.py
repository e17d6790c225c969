"""GGUF block formats that ``QuantizedLinear`` keeps as the file's codes: their layouts and torch dequantization.

A GGUF block tensor ``[N, K]`` stores each row as ``K / values`` blocks of ``nbytes`` bytes (ggml-common.h).
Tandem splits every block into its fp16 field(s) (``scale``: d; Q4_1's (d, m); Q4_K's (d, dmin)) and the
rest, kept byte for byte (``qweight``), so a row is its scales followed by its code bytes:

  format  GGUF  values  bytes  scale         qweight bytes per block (in file order)
  q8_0    Q8_0    32     34    d             32 int8 codes
  int4    Q4_0    32     18    d             16: byte j = weights j (low nibble), j + 16 (high)
  q4_1    Q4_1    32     20    (d, m)        16, as Q4_0
  q5_0    Q5_0    32     22    d             4 bytes qh (bit j: 5th bit of weight j), 16 bytes as Q4_0
  q4_k    Q4_K   256    144    (d, dmin)     12 bytes of 6-bit (scale, min) pairs of 8 sub-blocks of 32,
                                             128 bytes: per 64 weights, 32 bytes (sub-block 2i low nibbles,
                                             2i + 1 high nibbles)
  q6_k    Q6_K   256    210    d (last 2)    128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales

Values (ggml-quants.c ``dequantize_row_*``, gguf-py ``gguf.quants``):
  q5_0  ``w = d * ((u | h << 4) - 16)``
  q4_k  ``w = (d * sc_j) * u - dmin * m_j`` for sub-block j (``get_scale_min_k4`` unpacks sc_j, m_j)
  q6_k  ``w = (d * sc_g) * (q - 32)`` for group g of 16 weights, q = 4 low bits | 2 high bits << 4
Each dequantizer below computes in float32 with the same operations in the same order as gguf-py, so its
result is bit-identical to ``gguf.quants.dequantize`` of the original blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockLayout:
    """One GGUF block type: ``values`` weights in ``nbytes`` bytes; byte ranges of its fp16 scale field(s)
    and of its code bytes within a block."""

    values: int
    nbytes: int
    scale: tuple[int, int]
    codes: tuple[int, int]

    @property
    def scale_halves(self) -> int:
        return (self.scale[1] - self.scale[0]) // 2

    @property
    def code_bytes(self) -> int:
        return self.codes[1] - self.codes[0]


LAYOUTS: dict[str, BlockLayout] = {
    "q8_0": BlockLayout(32, 34, (0, 2), (2, 34)),
    "int4": BlockLayout(32, 18, (0, 2), (2, 18)),
    "q4_1": BlockLayout(32, 20, (0, 4), (4, 20)),
    "q5_0": BlockLayout(32, 22, (0, 2), (2, 22)),
    "q4_k": BlockLayout(256, 144, (0, 4), (4, 144)),
    "q6_k": BlockLayout(256, 210, (208, 210), (0, 208)),
}
KQUANT_FORMATS = ("q5_0", "q4_k", "q6_k")  # the formats of this module's dequantizers


def block_shapes(fmt: str, n: int, k: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{"qweight": (shape, dtype), "scale": (shape, fp16)}`` of an ``[n, k]`` tensor in block format ``fmt``.

    Raises:
        ValueError: ``k`` is not a multiple of the format's block size.
    """
    layout = LAYOUTS[fmt]
    if k % layout.values:
        raise ValueError(f"{fmt} needs an input size that is a multiple of {layout.values}, got {k}")
    blocks = k // layout.values
    codes = ((n, k), torch.int8) if fmt == "q8_0" else ((n, blocks * layout.code_bytes), torch.uint8)
    scale = (n, blocks, 2) if layout.scale_halves == 2 else (n, blocks)
    return {"qweight": codes, "scale": (scale, torch.float16)}


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 16 * j]`` -> int16 ``[..., 2, 16 * j]``: the low nibbles, then the high nibbles."""
    b = b.to(torch.int16)
    return torch.stack([b & 0xF, b >> 4], dim=-2)


def dequantize_q5_0(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 ``[N, K]`` of a q5_0 layer: ``qweight [N, K/32 * 20]`` uint8, ``scale [N, K/32]`` fp16."""
    n, blocks = scale.shape
    codes = qweight.view(n, blocks, 20).to(torch.int32)
    qh = codes[..., 0] | codes[..., 1] << 8 | codes[..., 2] << 16 | codes[..., 3] << 24  # [n, blocks] (LE)
    high = (qh[..., None] >> torch.arange(32, dtype=torch.int32)) & 1  # bit j -> weight j
    low = _nibbles(qweight.view(n, blocks, 20)[..., 4:]).reshape(n, blocks, 32)
    q = (low | (high << 4).to(torch.int16)) - 16
    return (scale.float()[..., None] * q.float()).view(n, -1)


def q4_k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 6-bit (scale, min) of the 8 sub-blocks from Q4_K's 12 bytes ``[..., 12]`` -> two int16 ``[..., 8]``.

    Bytes 0-3: sc_0..3 (low 6 bits) + 2 high bits of sc_4..7; 4-7: m_0..3 + 2 high bits of m_4..7;
    8-11: low 4 bits of sc_4..7 (low nibble) and m_4..7 (high nibble) (ggml ``get_scale_min_k4``).
    """
    p = packed.to(torch.int16)
    d, m, md = p[..., 0:4], p[..., 4:8], p[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0xF) | ((d >> 6) << 4)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 6) << 4)], dim=-1)
    return sc, mn


def dequantize_q4_k(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 ``[N, K]`` of a q4_k layer: ``qweight [N, K/256 * 140]`` uint8, ``scale [N, K/256, 2]`` (d, dmin)."""
    n, blocks = scale.shape[:2]
    codes = qweight.view(n, blocks, 140)
    sc, mn = q4_k_scale_min(codes[..., :12])
    s = scale.float()
    d = (s[..., 0:1] * sc.float())[..., None]  # [n, blocks, 8, 1]
    dm = (s[..., 1:2] * mn.float())[..., None]
    u = _nibbles(codes[..., 12:].reshape(n, blocks, 4, 32)).reshape(n, blocks, 8, 32).float()
    return (d * u - dm).view(n, -1)


def dequantize_q6_k(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 ``[N, K]`` of a q6_k layer: ``qweight [N, K/256 * 208]`` uint8, ``scale [N, K/256]`` fp16 (d)."""
    n, blocks = scale.shape
    codes = qweight.view(n, blocks, 208)
    low = _nibbles(codes[..., :128].reshape(n, blocks, 2, 2, 32))  # [n, b, half, 32-row, nibble, 32]
    low = low.transpose(-3, -2).reshape(n, blocks, 2, 4, 32)  # value 128 h + 32 i + l: L0 lo, L1 lo, L0 hi, L1 hi
    qh = codes[..., 128:192].reshape(n, blocks, 2, 1, 32).to(torch.int16)
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.int16)[:, None]) & 3
    q = (low | high << 4) - 32
    sc = codes[..., 192:208].view(torch.int8).float()  # [n, blocks, 16]
    d = scale.float()[..., None] * sc
    return (d[..., None] * q.reshape(n, blocks, 16, 16).float()).view(n, -1)


def dequantize(fmt: str, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 ``[N, K]`` of a layer in one of ``KQUANT_FORMATS``.

    Raises:
        ValueError: another format.
    """
    fns = {"q5_0": dequantize_q5_0, "q4_k": dequantize_q4_k, "q6_k": dequantize_q6_k}
    if fmt not in fns:
        raise ValueError(f"format must be one of {KQUANT_FORMATS}, got {fmt!r}")
    return fns[fmt](qweight, scale)
