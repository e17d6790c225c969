"""The packed bf16 linear (``kernels.pack_bf16`` + ``linear_bf16_packed``, both variants) and its layers.

References are independent of the kernel: float64 ``x @ w.T + b`` of the same bf16 values, ``F.embedding``
and the weight itself for the packing. Bound: each (token, row) value is one fp32 chain over the K pairs
(``vdpbf16ps`` on avx512_bf16, two FMAs on avx2: each rounds after each of the two products of a pair, at
most K roundings, ``(K + 2) 2^-24`` of ``|x| @ |w|.T + |b|``) plus the output's bf16 rounding (2^-8 relative).
The kernel tests run on every variant this CPU runs (an AVX-512 CPU runs the avx2 one too).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem import kernels
from tandem.kernels import build, registry
from tandem.models.layers import Embedding, Linear, pack_linears

VARIANTS = [pytest.param(v, marks=pytest.mark.skipif(build.load_variant(v) is None,
                                                     reason=f"the {v} variant does not run on this CPU"))
            for v in ("avx512_bf16", "avx2")]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(params=VARIANTS)
def kernel(request):
    """The variant's ``linear_bf16_packed``."""
    return build.load_variant(request.param).linear_bf16_packed


def bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 reference ``[M, N]``, its error bound) for bf16 ``x [M, K]``, ``w [N, K]``, ``b [N]``."""
    b64 = torch.zeros(w.shape[0], dtype=torch.float64) if b is None else b.double()
    ref = x.double() @ w.double().T + b64
    mag = x.double().abs() @ w.double().abs().T + b64.abs()
    return ref, 2**-8 * ref.abs() + (x.shape[1] + 2) * 2**-24 * mag + 1e-30


@pytest.mark.parametrize(("n", "k"), [(1, 2), (63, 64), (64, 64), (65, 96), (130, 64), (200, 898)])
def test_pack_unpack_and_rows_are_the_weight(n: int, k: int) -> None:
    w = torch.randn(n, k, generator=gen(n + k)).bfloat16()
    packed = kernels.pack_bf16(w)
    assert packed.shape == (n, k) and packed.dtype == torch.bfloat16
    assert packed.untyped_storage().nbytes() == -(-n // 64) * 64 * k * 2
    assert torch.equal(kernels.unpack_bf16(packed), w)
    ids = torch.tensor([0, n - 1, n // 2, 0, n - 1], dtype=torch.int64)
    assert torch.equal(kernels.packed_rows(packed, ids), F.embedding(ids, w))


@pytest.mark.parametrize(("m", "n", "k"), [(1, 1, 2), (1, 64, 64), (3, 100, 130), (6, 64, 896), (7, 300, 64),
                                           (16, 1152, 896), (33, 65, 898), (300, 70, 128)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_reference(m: int, n: int, k: int, bias: bool, kernel) -> None:
    g = gen(m * 7 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g)
    x[:, 3::97] *= 40.0  # outliers
    x = x.bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    y = kernel(x, kernels.pack_bf16(w), b)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    ref, tol = bound(x, w, b)
    assert ((y.double() - ref).abs() <= tol).all()


@pytest.mark.parametrize(("n", "k"), [(21, 896), (130, 64), (64, 4864)])
def test_every_token_count_is_one_token_bits(n: int, k: int, kernel) -> None:
    """M = 2 .. 40 (whole and partial register tiles of either variant) and 300 against M = 1, bit for bit,
    wherever a token sits."""
    g = gen(n * k)
    w = kernels.pack_bf16(torch.randn(n, k, generator=g).bfloat16())
    b = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(300, k, generator=g).bfloat16()
    alone = torch.cat([kernel(x[i : i + 1], w, b) for i in range(300)])
    for m in [*range(2, 41), 300]:
        for start in {0, 300 - m, (300 - m) // 2}:
            assert torch.equal(kernel(x[start : start + m], w, b), alone[start : start + m]), (m, start)


def test_strided_input_and_inf_nan_like_f_linear(kernel) -> None:
    g = gen(5)
    w = torch.randn(40, 64, generator=g).bfloat16()
    x = torch.randn(4, 64, generator=g).bfloat16()
    packed = kernels.pack_bf16(w)
    strided = torch.cat([x, x], dim=1)[:, :64]
    assert torch.equal(kernel(strided, packed), kernel(x, packed))
    x[0, 5] = float("inf")
    w[7, 5] = 0.0  # inf * 0 -> NaN in row 0, column 7
    x[3, 9] = float("nan")
    ref = x.double() @ w.double().T
    y = kernel(x, kernels.pack_bf16(w)).double()
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
    assert torch.equal(y[ref.isinf()], ref[ref.isinf()])


def test_bad_arguments_raise(kernel) -> None:
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    packed = kernels.pack_bf16(torch.zeros(70, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="even K"):
        kernels.pack_bf16(torch.zeros(4, 63, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16"):
        kernels.pack_bf16(torch.zeros(4, 64))
    with pytest.raises(RuntimeError, match="disagree on K"):
        kernel(torch.zeros(2, 66, dtype=torch.bfloat16), packed)
    with pytest.raises(RuntimeError, match="bf16 only"):
        kernel(x.float(), packed)
    with pytest.raises(RuntimeError, match="not a pack_bf16 weight"):
        kernel(x, torch.zeros(70, 64, dtype=torch.bfloat16))  # storage of 70 rows, not 2 panels
    with pytest.raises(RuntimeError, match="bias must be bf16"):
        kernel(x, packed, torch.zeros(69, dtype=torch.bfloat16))


class Tied(torch.nn.Module):
    """An embedding with a tied head (``LlamaForCausalLM``'s sharing) and a linear with a bias."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.embed = Embedding(vocab, dim, torch.bfloat16)
        self.proj = Linear(dim, [dim, 6], True, torch.bfloat16)
        self.head = Linear(dim, vocab, False, torch.bfloat16)
        self.head.weight = self.embed.weight
        g = gen(9)
        for p in self.parameters():
            p.copy_(torch.randn(p.shape, generator=g).bfloat16())


PACKING = pytest.mark.skipif(not registry.use("linear_bf16_packed"),
                             reason="the selected kernel backend (torch) has no packed kernel: nothing packs")


@PACKING
def test_pack_linears_keeps_values_and_frees_the_dense_weights() -> None:
    torch.manual_seed(0)
    model = Tied(100, 32)
    embed_w, proj_w, proj_b = model.embed.weight.clone(), model.proj.weight.clone(), model.proj.bias.clone()
    ids = torch.tensor([3, 99, 0, 3])
    with torch.inference_mode():
        h = model.embed(ids)
        assert pack_linears(model) == 2
        assert "weight" not in dict(model.proj.named_parameters()) and model.proj.packed is not None
        assert model.embed.packed is model.head.packed  # one table for the tied pair
        assert not any(name.endswith("weight") for name, _ in model.named_parameters())
        assert torch.equal(model.embed(ids), h)
        assert torch.equal(model.proj.dense_weight(), proj_w) and torch.equal(model.head.dense_weight(), embed_w)
        for layer, w, b in ((model.proj, proj_w, proj_b), (model.head, embed_w, None)):
            ref, tol = bound(h, w, b)
            assert ((layer(h).double() - ref).abs() <= tol).all()
            fmt, packed, scale, bias = layer.kernel_linear(4)
            assert fmt == "bf16_packed" and packed is layer.packed and scale is None and bias is layer.bias
        assert pack_linears(model) == 0  # already packed


def test_pack_linears_leaves_float32_and_disabled_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    fp32 = Linear(32, 8, False, torch.float32)
    assert not fp32.packable() and pack_linears(torch.nn.Sequential(fp32)) == 0
    monkeypatch.setenv("TANDEM_PACKED_BF16", "0")
    model = Tied(64, 32)
    assert pack_linears(model) == 0 and model.proj.packed is None and model.proj.kernel_linear(4)[0] == "bf16"


@PACKING
def test_packed_linear_falls_back_to_torch_off_the_kernel_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A packed layer still gives F.linear's values when the registry no longer picks the packed kernel."""
    model = Tied(64, 32)
    w, b = model.proj.weight.clone(), model.proj.bias.clone()
    pack_linears(model)
    x = torch.randn(3, 32, generator=gen(2)).bfloat16()
    monkeypatch.setattr(registry, "use", lambda op, tokens=None: False)
    assert model.proj.kernel_linear(3) is None
    assert torch.equal(model.proj(x), F.linear(x, w, b))
