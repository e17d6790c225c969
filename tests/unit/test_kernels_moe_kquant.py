"""The fused MoE kernel with GGUF Q4_K / Q6_K experts (``kernels.moe_kquant``) against an independent float64
reference: gguf-py's dequantization of the same random blocks (``test_kernels_kquant.random_blocks``), each
(token, slot) in float64.

Bounds: the kernel quantizes the routed tokens and the intermediate activations per token and block of 256
(llama.cpp's q8_K, as ``linear_q4_k`` / ``linear_q6_k`` do). ``_float64(..., q8k=True)`` applies that rounding
(fp32 ``iscale = 127 / max|x_B|``, round half to even, ``d = 1 / iscale``), so the kernel differs from it by the
fp32 sums of the block terms and the bf16 roundings of the intermediate and the output: 2^-6 of the largest
output covers them (the terms of a row are up to ~100x its result here). Against the plain float64 MoE the
activation rounding adds at most ``max|x_B| / 254`` per value (2-4% of the largest output here: below 2^-4).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem import kernels
from tests.unit.test_kernels_kquant import random_blocks, reference, split

pytestmark = pytest.mark.skipif(not kernels.available("moe_kquant"),
                                reason=f"moe_kquant kernel: {kernels.unavailable_reason('moe_kquant')}")

E, H, I, K = 6, 512, 256, 2  # K-quants need multiples of 256
PAIRS = [("q4_k", "q4_k"), ("q4_k", "q6_k"), ("q6_k", "q6_k")]  # (w13, w2): llama.cpp's Q4_K_M mixes


def _stack(fmt: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(codes [E, ...], scales [E, ...], float64 weights per expert by gguf-py) of random blocks."""
    parts = [random_blocks(fmt, n, k, seed * 100 + e) for e in range(E)]
    codes, scales = zip(*(split(fmt, b) for b in parts), strict=True)
    return torch.stack(codes), torch.stack(scales), [reference(fmt, b) for b in parts]


def _experts(pair: tuple[str, str], seed: int):
    w13_q, w13_s, w13 = _stack(pair[0], 2 * I, H, seed)
    w2_q, w2_s, w2 = _stack(pair[1], H, I, seed + 1)
    return (w13_q, w13_s, w2_q, w2_s), (w13, w2)


def _routing(t: int, seed: int, ids: torch.Tensor | None = None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g) * 0.02
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    return x.bfloat16(), torch.softmax(torch.randn(t, K, generator=g), dim=-1), ids


def _q8k(v: torch.Tensor) -> torch.Tensor:
    """float64 of ``v [n]`` (n a multiple of 256) after llama.cpp's q8_K rounding, as the kernel does it."""
    b = v.float().view(-1, 256)
    m = b.abs().amax(dim=1, keepdim=True)
    iscale = torch.where(m > 0, torch.tensor(127.0) / m, torch.zeros_like(m))
    d = torch.where(m > 0, 1.0 / iscale, torch.zeros_like(m))
    return (torch.round(b * iscale).double() * d.double()).flatten()


def _float64(x, dense, weights, ids, q8k: bool) -> torch.Tensor:
    w13, w2 = dense
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = _q8k(x[t]) if q8k else x[t].double()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ xt).chunk(2)
            h = (F.silu(gate) * up).bfloat16()
            h = _q8k(h) if q8k else h.double()
            out[t] += float(weights[t, j]) * (w2[e] @ h)
    return out


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("t", [1, 3, 17, 40])
def test_matches_float64_reference_of_gguf_py_weights(pair, t: int) -> None:
    tensors, dense = _experts(pair, seed=t)
    x, weights, ids = _routing(t, seed=t)
    got = kernels.moe_kquant(x, *tensors, weights, ids, *pair)
    assert got.dtype == torch.bfloat16 and got.shape == (t, H)
    assert _rel(got, _float64(x, dense, weights, ids, q8k=True)) < 2**-6
    assert _rel(got, _float64(x, dense, weights, ids, q8k=False)) < 2**-4


@pytest.mark.parametrize("pair", PAIRS[1:])
def test_idle_experts_are_never_read_and_one_expert_gets_every_token(pair) -> None:
    tensors, dense = _experts(pair, seed=3)
    t = 24
    ids = torch.stack([torch.tensor([3, 4 if i % 2 else 5]) for i in range(t)])  # expert 3: all; 0, 1, 2: none
    x, weights, _ = _routing(t, seed=7, ids=ids)
    poisoned = [p.clone() for p in tensors]
    for scales in (poisoned[1], poisoned[3]):
        scales[[0, 1, 2]] = float("nan")  # never read: would turn every output NaN
    got = kernels.moe_kquant(x, *poisoned, weights, ids, *pair)
    assert _rel(got, _float64(x, dense, weights, ids, q8k=True)) < 2**-6


def test_batch_invariant_bit_for_bit() -> None:
    """Each token's output is the same alone and among 1..40 others (any grouping by expert)."""
    pair = PAIRS[1]
    tensors, _ = _experts(pair, seed=4)
    x, weights, ids = _routing(40, seed=5)
    full = kernels.moe_kquant(x, *tensors, weights, ids, *pair)
    for t in range(0, 40, 3):
        one = kernels.moe_kquant(x[t : t + 1], *tensors, weights[t : t + 1], ids[t : t + 1], *pair)
        assert torch.equal(one, full[t : t + 1]), t
    for n in (2, 7, 16):
        assert torch.equal(kernels.moe_kquant(x[:n], *tensors, weights[:n], ids[:n], *pair), full[:n])


def test_bad_input_is_a_clear_error() -> None:
    tensors, _ = _experts(PAIRS[1], seed=0)
    x, weights, ids = _routing(2, seed=0)
    with pytest.raises(RuntimeError, match="moe_kquant w13: format must be q4_k or q6_k, got q8_0"):
        kernels.moe_kquant(x, *tensors, weights, ids, "q8_0", "q6_k")
    with pytest.raises(RuntimeError, match="moe_kquant w2: q4_k experts need contiguous uint8 codes"):
        kernels.moe_kquant(x, *tensors, weights, ids, "q4_k", "q4_k")  # w2 holds Q6_K's 208-byte blocks
    with pytest.raises(RuntimeError, match="moe_kquant: expert id 6 out of range"):
        kernels.moe_kquant(x, *tensors, weights, torch.full_like(ids, E), *PAIRS[1])
    with pytest.raises(RuntimeError, match="do not match"):
        kernels.moe_kquant(torch.zeros(2, 256, dtype=torch.bfloat16), *tensors, weights, ids, *PAIRS[1])


def test_quantized_experts_kernel_and_torch_paths_agree() -> None:
    """``QuantizedExperts.empty("q4_k", ..., w2_method="q6_k")`` filled with codes: the kernel (bf16) and the
    dequantized torch path (float32)."""
    from tandem.models.moe_quant import QuantizedExperts

    tensors, dense = _experts(PAIRS[1], seed=6)
    q = QuantizedExperts.empty("q4_k", E, H, I, w2_method="q6_k")
    for buf, src in zip((q.w13_q, q.w13_s, q.w2_q, q.w2_s), tensors, strict=True):
        buf.copy_(src)
    x, weights, ids = _routing(6, seed=8)
    fast = q(x, weights, ids)
    slow = q(x.float(), weights, ids)  # float32: no kernel, dequantized once
    assert q.dense is not None and q.dense[0].dtype == torch.float32
    assert _rel(fast, slow.double()) < 2**-4
    assert _rel(fast, _float64(x, dense, weights, ids, q8k=True)) < 2**-6
    with pytest.raises(ValueError, match="w13 and w2 each one of"):
        QuantizedExperts.empty("q8_0", E, H, I, w2_method="q6_k")
