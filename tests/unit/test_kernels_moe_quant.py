"""The fused MoE kernel with int8 / int4 / q8_0 experts (``kernels.moe_int8`` / ``moe_int4`` / ``moe_q8_0``)
against an independent float64 reference of the dequantized experts, for batch invariance, and wired into a
model by ``quantize_model``. q8_0 experts are random GGUF codes (any int8, fp16 scale per group of 32).

Bounds: the kernel quantizes the routed tokens and the intermediate activations to int8 per block of 32
(llama.cpp's q8_0 activations, as ``linear_int8`` / ``linear_int4`` do). ``_float64`` with
``quantized_acts=True`` applies that rounding in float64 (``test_kernels_linear.quantize_activations``), so
the kernel differs from it by fp32 sums and bf16 roundings only (the output's 2^-8, an intermediate landing
on a rounding boundary: a small absolute term); against the plain float64 MoE of the dequantized weights the
activation rounding (at most max|x_b| / 254 per value) adds about 1% of the largest output on inputs without
outliers (checked below 2^-5 of it).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem import kernels
from tandem.models.moe_quant import QuantizedExperts, quantize_stack
from tandem.models.quant import dequantize_weight
from tests.unit.test_kernels_linear import quantize_activations

pytestmark = pytest.mark.skipif(not kernels.available("moe_int8"),
                                reason=f"moe_int8 kernel: {kernels.unavailable_reason('moe_int8')}")

E, H, I, K = 8, 96, 64, 2  # int4 needs multiples of 32


def _experts(method: str, seed: int, h: int = H, i: int = I) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    if method == "q8_0":  # a GGUF's codes: any int8, fp16 scale per group of 32
        return tuple(t for n, k in ((2 * i, h), (h, i)) for t in (
            torch.randint(-128, 128, (E, n, k), dtype=torch.int8, generator=g),
            (torch.rand(E, n, k // 32, generator=g) * 0.002 + 0.0005).half()))
    w13 = torch.randn(E, 2 * i, h, generator=g) * 0.2
    w2 = torch.randn(E, h, i, generator=g) * 0.2
    return (*quantize_stack(w13, method), *quantize_stack(w2, method))


def _routing(t: int, seed: int, h: int = H, ids: torch.Tensor | None = None, outliers: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    if outliers:  # blocks dominated by one value: their other values keep few bits
        x[:, 5::37] *= 20.0
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, K, generator=g), dim=-1)
    return x.bfloat16(), weights, ids


def _fake_quant(v: torch.Tensor) -> torch.Tensor:
    """float64 of ``v [n]`` after int8 rounding per block of 32 (zero-padded), as the kernel's activations."""
    xq, dx = quantize_activations(v[None])
    return (xq.double() * dx.double()[..., None]).flatten()[: v.shape[0]]


def _float64(method: str, x, tensors, weights, ids, quantized_acts: bool) -> torch.Tensor:
    """Independent oracle: each (token, slot) in float64 with the dequantized experts; the intermediate
    rounded to bf16 as the kernel does, and (``quantized_acts``) the activations rounded as it does."""
    w13 = [dequantize_weight(method, q, s).double() for q, s in zip(tensors[0], tensors[1], strict=True)]
    w2 = [dequantize_weight(method, q, s).double() for q, s in zip(tensors[2], tensors[3], strict=True)]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = _fake_quant(x[t].float()) if quantized_acts else x[t].double()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ xt).chunk(2)
            h = (F.silu(gate) * up).bfloat16()
            h = _fake_quant(h.float()) if quantized_acts else h.double()
            out[t] += float(weights[t, j]) * (w2[e] @ h)
    return out


def _kernel(method: str):
    return getattr(kernels, f"moe_{method}")


@pytest.mark.parametrize("method", ["int8", "int4", "q8_0"])
@pytest.mark.parametrize("t", [1, 2, 3, 8, 17, 40])
def test_matches_float64_reference_of_the_dequantized_experts(method: str, t: int) -> None:
    tensors = _experts(method, seed=0)
    x, weights, ids = _routing(t, seed=t)
    got = _kernel(method)(x, *tensors, weights, ids)
    assert got.dtype == torch.bfloat16 and got.shape == (t, H)
    ref = _float64(method, x, tensors, weights, ids, quantized_acts=True)
    torch.testing.assert_close(got.double(), ref, rtol=2**-7, atol=3e-2)
    x, weights, ids = _routing(t, seed=t, outliers=False)
    got = _kernel(method)(x, *tensors, weights, ids)
    plain = _float64(method, x, tensors, weights, ids, quantized_acts=False)
    # without outliers, activation rounding moves each value by <= max|x_b| / 254: ~1% of the largest output
    assert ((got.double() - plain).abs().max() / plain.abs().max()).item() < 2**-5


def test_int8_sizes_that_are_not_multiples_of_32() -> None:
    """int8 takes any H and I (a zero-padded last block of activations)."""
    tensors = _experts("int8", seed=1, h=72, i=40)
    x, weights, ids = _routing(5, seed=2, h=72)
    got = kernels.moe_int8(x, *tensors, weights, ids)
    torch.testing.assert_close(got.double(), _float64("int8", x, tensors, weights, ids, True), rtol=2**-7, atol=3e-2)


@pytest.mark.parametrize("method", ["int8", "int4", "q8_0"])
def test_idle_experts_are_never_read_and_one_expert_gets_every_token(method: str) -> None:
    tensors = _experts(method, seed=3)
    t = 24
    ids = torch.stack([torch.tensor([3, 5 if i % 2 else 6]) for i in range(t)])  # expert 3: all; 0,1,2,4,7: none
    x, weights, _ = _routing(t, seed=7, ids=ids)
    poisoned = [p.clone() for p in tensors]
    for scales in (poisoned[1], poisoned[3]):
        scales[[0, 1, 2, 4, 7]] = float("nan")  # never read: would turn every output NaN
    got = _kernel(method)(x, *poisoned, weights, ids)
    ref = _float64(method, x, tensors, weights, ids, quantized_acts=True)
    torch.testing.assert_close(got.double(), ref, rtol=2**-7, atol=3e-2)


@pytest.mark.parametrize("method", ["int8", "int4", "q8_0"])
def test_batch_invariant_bit_for_bit(method: str) -> None:
    """Each token's output is the same alone and among 1..40 others (any grouping by expert)."""
    tensors = _experts(method, seed=4)
    x, weights, ids = _routing(40, seed=5)
    full = _kernel(method)(x, *tensors, weights, ids)
    for t in range(40):
        assert torch.equal(_kernel(method)(x[t : t + 1], *tensors, weights[t : t + 1], ids[t : t + 1]),
                           full[t : t + 1]), t
    for n in (2, 7, 16):
        assert torch.equal(_kernel(method)(x[:n], *tensors, weights[:n], ids[:n]), full[:n])


def test_bad_input_is_a_clear_error() -> None:
    tensors = _experts("int4", seed=0)
    x, weights, ids = _routing(2, seed=0)
    with pytest.raises(RuntimeError, match="moe_int4: expert id 8 out of range"):
        kernels.moe_int4(x, *tensors, weights, torch.full_like(ids, E))
    with pytest.raises(RuntimeError, match="do not match"):
        kernels.moe_int4(torch.zeros(2, 2 * H, dtype=torch.bfloat16), *tensors, weights, ids)
    with pytest.raises(RuntimeError, match="int8 experts need int8 codes"):
        kernels.moe_int8(x, *tensors, weights, ids)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_experts_kernel_and_torch_paths_agree(method: str) -> None:
    """``QuantizedExperts``: the kernel (bf16) and the dequantized torch path (float32) on the same codes."""
    from tandem.models.moe import FusedExperts

    experts = FusedExperts(E, H, I, torch.bfloat16)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        experts.w13.copy_(torch.randn(E, 2 * I, H, generator=g) * 0.2)
        experts.w2.copy_(torch.randn(E, H, I, generator=g) * 0.2)
    q = QuantizedExperts(experts, method)
    assert q.method == method and q.w13_q.shape[0] == E
    x, weights, ids = _routing(6, seed=8, outliers=False)
    fast = q(x, weights, ids)
    slow = q(x.float(), weights, ids)  # float32: no kernel, dequantized once
    assert q.dense is not None and q.dense[0].dtype == torch.float32
    assert ((fast.double() - slow.double()).abs().max() / slow.abs().max()).item() < 2**-5
    torch.testing.assert_close(fast.double(), _float64(method, x, (q.w13_q, q.w13_s, q.w2_q, q.w2_s), weights, ids,
                                                       quantized_acts=True), rtol=2**-7, atol=3e-2)
