"""The fused MoE kernel (``kernels.moe_bf16``) against a float64 reference and for batch invariance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem import kernels
from tandem.kernels import registry
from tandem.models.moe import moe_grouped, moe_reference

pytestmark = pytest.mark.skipif(not kernels.available("moe_bf16"),
                                reason=f"moe_bf16 kernel: {kernels.unavailable_reason('moe_bf16')}")

E, H, I, K = 8, 72, 40, 2  # H, I not multiples of 16: every tail path of the dot products runs


def _weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.2).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * 0.2).bfloat16()
    return w13, w2


def _routing(t: int, seed: int, ids: torch.Tensor | None = None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).bfloat16()
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, K, generator=g), dim=-1)
    return x, weights, ids


def _float64(x, w13, w2, weights, ids) -> torch.Tensor:
    """Independent oracle: each (token, slot) in float64, intermediate rounded to bf16 as the kernel does."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            h = (F.silu(gate) * up).bfloat16().double()
            out[t] += float(weights[t, j]) * (w2[e].double() @ h)
    return out


@pytest.mark.parametrize("t", [1, 2, 3, 5, 8, 17, 40])
def test_matches_float64_reference(t: int) -> None:
    w13, w2 = _weights()
    x, weights, ids = _routing(t, seed=t)
    got = kernels.moe_bf16(x, w13, w2, weights, ids)
    ref = _float64(x, w13, w2, weights, ids)
    # bf16 output rounding (2^-8 relative) plus fp32 sums; an intermediate that lands on a bf16 rounding
    # boundary may round the other way, hence a small absolute term.
    assert got.dtype == torch.bfloat16 and got.shape == (t, H)
    torch.testing.assert_close(got.double(), ref, rtol=2**-7, atol=2e-2)
    # The PyTorch path also rounds gate and up to bf16 (F.linear in bf16, as transformers does): looser.
    torch.testing.assert_close(moe_reference(x, w13, w2, weights, ids).double(), ref, rtol=2**-5, atol=0.1)


def test_idle_experts_and_an_expert_that_gets_every_token() -> None:
    w13, w2 = _weights(1)
    t = 24
    ids = torch.stack([torch.tensor([3, 5 if i % 2 else 6]) for i in range(t)])  # expert 3: all; 0,1,2,4,7: none
    x, weights, _ = _routing(t, seed=7, ids=ids)
    w13_poisoned = w13.clone()
    w13_poisoned[[0, 1, 2, 4, 7]] = float("nan")  # never read: would turn every output NaN
    got = kernels.moe_bf16(x, w13_poisoned, w2, weights, ids)
    torch.testing.assert_close(got.double(), _float64(x, w13, w2, weights, ids), rtol=2**-7, atol=2e-2)


def test_batch_invariant_bit_for_bit() -> None:
    """Each token's output is the same alone and among 1..40 others (any grouping by expert)."""
    w13, w2 = _weights(2)
    x, weights, ids = _routing(40, seed=3)
    full = kernels.moe_bf16(x, w13, w2, weights, ids)
    for t in range(40):
        alone = kernels.moe_bf16(x[t : t + 1], w13, w2, weights[t : t + 1], ids[t : t + 1])
        assert torch.equal(alone, full[t : t + 1]), t
    for n in (2, 7, 16):
        assert torch.equal(kernels.moe_bf16(x[:n], w13, w2, weights[:n], ids[:n]), full[:n])


def test_grouped_torch_path_is_also_batch_invariant() -> None:
    w13, w2 = _weights(3)
    x, weights, ids = _routing(12, seed=4)
    full = moe_grouped(x, w13, w2, weights, ids)
    for t in range(12):
        assert torch.equal(moe_grouped(x[t : t + 1], w13, w2, weights[t : t + 1], ids[t : t + 1]), full[t : t + 1])


def test_bad_input_is_a_clear_error() -> None:
    w13, w2 = _weights()
    x, weights, ids = _routing(2, seed=0)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.moe_bf16(x, w13, w2, weights, torch.full_like(ids, E))
    with pytest.raises(RuntimeError, match="do not match"):
        kernels.moe_bf16(x[:, :-1].contiguous(), w13, w2, weights, ids)
    assert registry.use("moe_bf16", tokens=1)
