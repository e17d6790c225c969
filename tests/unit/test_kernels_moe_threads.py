"""The fused MoE kernels' one parallel region (``csrc/avx2/moe_common.h`` ``expert_region``): every format's
output is bit-identical on 1, 2 and 3 threads, alone and batched, including an expert that gets every token
(its down tiles wait for its gate/up tiles, which the other threads hold) and a single selected expert (every
thread but one waits on it); the values themselves are checked against each format's float64 oracle.

The float64 oracles and tensors come from the per-format test modules (``test_kernels_moe``,
``test_kernels_moe_quant``, ``test_kernels_moe_kquant``).
"""

from __future__ import annotations

import pytest
import torch

from tandem import kernels
from tests.unit import test_kernels_moe as bf16_tests
from tests.unit import test_kernels_moe_kquant as kquant_tests
from tests.unit import test_kernels_moe_quant as quant_tests

pytestmark = pytest.mark.skipif(not kernels.available("moe_int4"),
                                reason=f"moe_int4 kernel: {kernels.unavailable_reason('moe_int4')}")

FORMATS = ["bf16", "int8", "int4", "q8_0", "q4_k/q6_k"]


def _case(fmt: str):
    """(module, call(x, weights, ids), oracle(x, weights, ids) float64, rtol, atol) of one format."""
    if fmt == "bf16":
        w13, w2 = bf16_tests._weights(seed=11)
        return (bf16_tests, lambda x, w, i: kernels.moe_bf16(x, w13, w2, w, i),
                lambda x, w, i: bf16_tests._float64(x, w13, w2, w, i), 2**-7, 1e-2)
    if fmt == "q4_k/q6_k":
        tensors, dense = kquant_tests._experts(("q4_k", "q6_k"), seed=12)
        return (kquant_tests, lambda x, w, i: kernels.moe_kquant(x, *tensors, w, i, "q4_k", "q6_k"),
                lambda x, w, i: kquant_tests._float64(x, dense, w, i, q8k=True), None, None)
    tensors = quant_tests._experts(fmt, seed=13)
    return (quant_tests, lambda x, w, i: getattr(kernels, f"moe_{fmt}")(x, *tensors, w, i),
            lambda x, w, i: quant_tests._float64(fmt, x, tensors, w, i, quantized_acts=True), 2**-7, 3e-2)


def _on_threads(n: int, call, *args) -> torch.Tensor:  # noqa: ANN001
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return call(*args)
    finally:
        torch.set_num_threads(before)


def _check_values(oracle, got: torch.Tensor, args: tuple, rtol: float | None, atol: float | None) -> None:  # noqa: ANN001
    ref = oracle(*args)
    if rtol is None:  # the K-quant module's relative bound (its header)
        assert kquant_tests._rel(got, ref) < 2**-6
    else:
        torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("fmt", FORMATS)
def test_bit_identical_on_1_2_3_threads_alone_and_batched(fmt: str) -> None:
    mod, call, oracle, rtol, atol = _case(fmt)
    x, weights, ids = mod._routing(40, seed=21)
    full = _on_threads(2, call, x, weights, ids)
    _check_values(oracle, full, (x, weights, ids), rtol, atol)
    for n in (1, 3):
        assert torch.equal(_on_threads(n, call, x, weights, ids), full), n
    for n, (t0, t1) in zip((1, 2, 3), ((0, 1), (7, 8), (3, 19)), strict=True):  # alone and among a few
        assert torch.equal(_on_threads(n, call, x[t0:t1], weights[t0:t1], ids[t0:t1]), full[t0:t1]), (n, t0, t1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_expert_gets_every_token_and_a_single_selected_expert(fmt: str) -> None:
    mod, call, oracle, rtol, atol = _case(fmt)
    k = mod.K
    every = torch.tensor([[1] + [2 + (i + j) % 3 for j in range(k - 1)] for i in range(16)])  # 0, 5+: idle
    for t, ids in ((16, every), (1, torch.full((1, k), 3))):  # (1, k): expert 3 in every slot, the only one
        x, weights, _ = mod._routing(t, seed=22, ids=ids)
        alone = _on_threads(1, call, x, weights, ids)
        _check_values(oracle, alone, (x, weights, ids), rtol, atol)
        for n in (2, 3):
            assert torch.equal(_on_threads(n, call, x, weights, ids), alone), (fmt, t, n)
