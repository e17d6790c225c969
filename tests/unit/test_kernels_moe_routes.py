"""On an ``avx512_bf16`` CPU the fused MoE kernels run from the avx2 build (``registry.ROUTES``): the
avx512_bf16 build has none of them. Simulated here on any AVX2 CPU: the selected variant is a stand-in
module without MoE operators, the avx2 one the real build. Each MoE block must then give exactly what the
avx2 kernel gives when called directly (the kernels themselves are checked against float64 references in
``test_kernels_moe.py`` / ``test_kernels_moe_quant.py``), and ``kernels.available`` must report them.
"""

from __future__ import annotations

import types

import pytest
import torch

from tandem import kernels
from tandem.kernels import build, registry
from tandem.models.moe import FusedExperts
from tandem.models.moe_quant import QuantizedExperts

AVX2 = build.load_variant("avx2") if build.variant_unsupported_reason("avx2") is None else None
_WHY = build.variant_unsupported_reason("avx2") or "build failed or lacks moe_int8"
pytestmark = pytest.mark.skipif(AVX2 is None or not hasattr(AVX2, "moe_int8"), reason=f"the avx2 kernels: {_WHY}")

E, H, I, K, T = 8, 96, 64, 2, 5


@pytest.fixture
def avx512_cpu(monkeypatch):
    """Pretend the process runs the avx512_bf16 build (a module with its operators but no MoE kernel)."""
    own = {op for op, limits in registry.LIMITS.items() if "avx512_bf16" in limits}
    avx512 = types.SimpleNamespace(**{op: getattr(AVX2, op) for op in own if hasattr(AVX2, op)})
    monkeypatch.setattr(build, "selected_variant", lambda: "avx512_bf16")
    monkeypatch.setattr(build, "load_variant", lambda v: {"avx512_bf16": avx512, "avx2": AVX2}[v])
    registry.cache_clear()
    yield
    registry.cache_clear()


def _routing(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[:, 0] = 3  # one expert takes every token, others none
    return x, torch.softmax(torch.randn(T, K, generator=g), dim=-1), ids


def _bf16_experts(seed: int) -> FusedExperts:
    g = torch.Generator().manual_seed(seed)
    block = FusedExperts(E, H, I, torch.bfloat16)
    block.w13.data = (torch.randn(E, 2 * I, H, generator=g) * 0.2).bfloat16()
    block.w2.data = (torch.randn(E, H, I, generator=g) * 0.2).bfloat16()
    return block


def test_bf16_experts_run_the_avx2_kernel_on_avx512(avx512_cpu) -> None:
    block = _bf16_experts(0)
    x, weights, ids = _routing(1)
    assert registry.backend_for("moe_bf16") == "avx2" and kernels.available("moe_bf16")
    expected = AVX2.moe_bf16(x, block.w13, block.w2, weights, ids)
    torch.testing.assert_close(block(x, weights, ids), expected, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_experts_run_the_avx2_kernel_on_avx512(avx512_cpu, method: str) -> None:
    block = QuantizedExperts(_bf16_experts(2), method)
    assert block.method == method
    x, weights, ids = _routing(3)
    op = f"moe_{method}"
    assert registry.backend_for(op) == "avx2" and kernels.available(op) and registry.use(op, T)
    expected = getattr(AVX2, op)(x, block.w13_q, block.w13_s, block.w2_q, block.w2_s, weights, ids)
    torch.testing.assert_close(block(x, weights, ids), expected, rtol=0, atol=0)


def test_without_an_avx2_build_the_experts_fall_back_to_torch(monkeypatch) -> None:
    avx512 = types.SimpleNamespace(linear_bf16=AVX2.linear_bf16)
    monkeypatch.setattr(build, "selected_variant", lambda: "avx512_bf16")
    monkeypatch.setattr(build, "load_variant", lambda v: avx512 if v == "avx512_bf16" else None)
    registry.cache_clear()
    try:
        assert registry.backend_for("moe_int8") == "torch" and not kernels.available("moe_int8")
        with pytest.raises(AttributeError, match="no compiled kernel runs moe_int8"):
            kernels.moe_int8(*(torch.empty(0),) * 7)
    finally:
        registry.cache_clear()
