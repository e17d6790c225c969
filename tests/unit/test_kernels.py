"""Tandem's C++ CPU kernels against their PyTorch references (random inputs, odd sizes included).

Error bounds (why each tolerance is what it is):
  paged_attention  fp32: 1e-5 (exp polynomial < 2e-7 relative, summation order); bf16: vs the fp32
                   attention of the same bf16 values, one bf16 rounding of the output (2^-8 relative).
                   The caches must equal the reference's bit for bit.
  rms_norm, rotary, silu_and_mul reproduce PyTorch's intermediate bf16 roundings: they must match
                   exactly except where an fp32 last-bit difference flips a bf16 rounding (<= 1 bf16
                   ulp, on under 2% of elements); fp32 within 1e-6 relative.
Skips the whole module when the kernels cannot be built or run here (see tandem.kernels.build).
The linear kernels are tested in test_kernels_linear.py.
"""

from __future__ import annotations

import pytest
import torch

from tandem import kernels
from tandem.attention import AttentionMetadata, CpuPagedAttention, TorchRefAttention, select_backend
from tandem.models.layers import RMSNorm, SiluAndMul, apply_rotary

pytestmark = pytest.mark.skipif(
    not kernels.available("paged_attention"),
    reason=f"Tandem CPU kernels unavailable: {kernels.unavailable_reason('paged_attention')}",
)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_step(heads: int, kv: int, d: int, block: int, dtype: torch.dtype, seed: int):
    """Random cache prefixes + one step's rows: decode, 1-token prompt, chunk after prefix, full prefill."""
    g = gen(seed)
    seq_lens, computed = [9, 1, 37, 6, 20, 3], [8, 0, 30, 5, 0, 2]
    num_blocks = sum(-(-n // block) for n in seq_lens) + 3
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // block))] for n in seq_lens]
    caches = [torch.zeros(num_blocks, block, kv, d, dtype=dtype) for _ in range(2)]
    prefix = AttentionMetadata.build([0] * len(seq_lens), computed, tables, block)
    total_prefix = sum(computed)
    for c in caches:
        c.view(-1, kv, d).index_copy_(0, prefix.slot_mapping, torch.randn(total_prefix, kv, d, generator=g).to(dtype))
    new = [n - c for n, c in zip(seq_lens, computed, strict=True)]
    meta = AttentionMetadata.build(computed, new, tables, block)
    t = sum(new)
    q, k, v = (torch.randn(t, h, d, generator=g).to(dtype) for h in (heads, kv, kv))
    return q, k, v, caches, meta


@pytest.mark.parametrize(("heads", "kv", "d", "block"), [(4, 2, 8, 4), (14, 2, 64, 16), (8, 8, 80, 16),
                                                         (6, 2, 128, 32), (7, 1, 24, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_reference(heads: int, kv: int, d: int, block: int, dtype: torch.dtype) -> None:
    q, k, v, (kc, vc), meta = make_step(heads, kv, d, block, dtype, seed=heads * d + block)
    scale = d**-0.5
    ref_kc, ref_vc = kc.clone().float(), vc.clone().float()
    expected = TorchRefAttention()(q.float(), k.float(), v.float(), ref_kc, ref_vc, meta, scale)
    out = torch.full_like(q, float("nan"))
    kernels.paged_attention(out, q, k, v, kc, vc, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                            meta.query_start_loc, scale, 1 << 30)
    assert torch.equal(kc.float(), ref_kc) and torch.equal(vc.float(), ref_vc)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:
        assert ((out.float() - expected).abs() <= 2**-8 * expected.abs() + 1e-5).all()


def test_paged_attention_leaves_long_rows_and_reads_strided_views() -> None:
    heads, kv, d = 4, 2, 16
    q, k, v, (kc, vc), meta = make_step(heads, kv, d, 4, torch.float32, seed=3)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)  # a fused projection's output
    qv, kv_, vv = qkv.split([heads * d, kv * d, kv * d], dim=1)
    qv, kv_, vv = qv.view(-1, heads, d), kv_.view(-1, kv, d), vv.view(-1, kv, d)
    expected = TorchRefAttention()(q, k, v, kc.clone(), vc.clone(), meta, 0.25)
    out = torch.full_like(q, float("nan"))
    kernels.paged_attention(out, qv, kv_, vv, kc, vc, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                            meta.query_start_loc, 0.25, 2)
    starts = meta.query_start_loc.tolist()
    for r in range(meta.num_reqs):
        rows = slice(starts[r], starts[r + 1])
        if starts[r + 1] - starts[r] <= 2:
            torch.testing.assert_close(out[rows], expected[rows], rtol=1e-5, atol=1e-5)
        else:
            assert out[rows].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_paged_backend_matches_reference_with_long_rows(dtype: torch.dtype) -> None:
    """max_query_len 2: the 7-token chunk after a prefix (gather) and the 20-token prompt take SDPA."""
    q, k, v, (kc, vc), meta = make_step(8, 2, 64, 16, dtype, seed=5)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    expected = TorchRefAttention()(q, k, v, ref_kc, ref_vc, meta, 0.125)
    out = CpuPagedAttention(max_query_len=2)(q, k, v, kc, vc, meta, 0.125)
    assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


def test_select_backend() -> None:
    assert isinstance(select_backend(64, torch.bfloat16), CpuPagedAttention)
    assert isinstance(select_backend(64, torch.bfloat16, "torch_ref"), TorchRefAttention)
    assert isinstance(select_backend(512, torch.bfloat16), TorchRefAttention)  # head_dim > 256
    with pytest.raises(ValueError, match="cannot run here"):
        select_backend(512, torch.float32, "cpu_paged")
    with pytest.raises(ValueError, match="must be one of"):
        select_backend(64, torch.float32, "flash")


def assert_matches_rounding(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal, except <= 1 bf16 ulp on < 2% of elements (bf16); 1e-6 relative (fp32)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
        return
    diff = (actual.float() - expected.float()).abs()
    assert (diff <= 2**-7 * expected.float().abs() + 1e-30).all()
    assert (diff > 0).float().mean() < 0.02


@pytest.mark.parametrize("dim", [8, 17, 64, 896])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_layer(dim: int, dtype: torch.dtype) -> None:
    g = gen(dim)
    norm = RMSNorm(dim, 1e-6, dtype)
    norm.weight.data.copy_(1 + 0.3 * torch.randn(dim, generator=g))
    x = (3 * torch.randn(5, dim, generator=g)).to(dtype)
    assert_matches_rounding(kernels.rms_norm(x, norm.weight, 1e-6), norm(x))


@pytest.mark.parametrize(("heads", "d"), [(4, 8), (14, 64), (3, 34), (2, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_apply_rotary(heads: int, d: int, dtype: torch.dtype) -> None:
    g = gen(heads * d)
    t = 6
    qk = torch.randn(t, 2 * heads * d, generator=g).to(dtype)
    x = qk[:, : heads * d].view(t, heads, d)  # a strided view, as from a fused projection
    angles = torch.rand(t, 1, d // 2, generator=g) * 100
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
    expected, _ = apply_rotary(x, x, cos, sin)
    assert_matches_rounding(kernels.rotary(x, cos, sin), expected)


@pytest.mark.parametrize("d", [1, 17, 172, 4864])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_layer(d: int, dtype: torch.dtype) -> None:
    x = (4 * torch.randn(3, 2 * d, generator=gen(d))).to(dtype)
    actual, expected = kernels.silu_and_mul(x), SiluAndMul()(x)
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    else:
        assert_matches_rounding(actual, expected)


@pytest.fixture
def torch_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the layers in tandem.models.layers take their PyTorch path (the kernels' oracle)."""
    from tandem.models import layers

    monkeypatch.setattr(layers, "_use_kernels", lambda *args: False)


@pytest.mark.parametrize("dim", [8, 17, 64, 896])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_matches_add_then_norm(dim: int, dtype: torch.dtype, torch_layers: None) -> None:
    g = gen(dim + 1)
    norm = RMSNorm(dim, 1e-6, dtype)
    norm.weight.data.copy_(1 + 0.3 * torch.randn(dim, generator=g))
    x = (3 * torch.randn(5, dim, generator=g)).to(dtype)
    residual = (3 * torch.randn(5, dim, generator=g)).to(dtype)
    expected_residual = residual + x  # one rounding of the fp32 sum, as the kernel does
    expected = norm(expected_residual)  # PyTorch path (fixture)
    # The layer's fused call on its PyTorch path: the same add, then the norm, out of place.
    fallback, fallback_residual = norm(x.clone(), residual.clone())
    assert torch.equal(fallback_residual, expected_residual) and torch.equal(fallback, expected)
    kernels.fused_add_rms_norm(x, residual, norm.weight, 1e-6)
    assert torch.equal(residual, expected_residual)
    assert_matches_rounding(x, expected)


def test_fused_add_rms_norm_rejects_bad_layouts() -> None:
    w = torch.ones(8, dtype=torch.bfloat16)
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.fused_add_rms_norm(torch.zeros(8, 4, dtype=torch.bfloat16).t(), x, w, 1e-6)
    with pytest.raises(RuntimeError, match="dtype"):
        kernels.fused_add_rms_norm(x, x.float(), w, 1e-6)
    with pytest.raises(RuntimeError, match=r"\[R, dim\]"):
        kernels.fused_add_rms_norm(x, torch.zeros(3, 8, dtype=torch.bfloat16), w, 1e-6)


@pytest.mark.parametrize(("heads", "kv", "d"), [(4, 2, 8), (14, 2, 64), (3, 1, 34), (2, 2, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_fused_qkv_matches_torch(heads: int, kv: int, d: int, dtype: torch.dtype,
                                                    torch_layers: None) -> None:
    g = gen(heads * d + kv)
    t = 5
    qkv = torch.randn(t, (heads + 2 * kv) * d, generator=g).to(dtype)
    angles = torch.rand(t, 1, d // 2, generator=g) * 100
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
    q_end, k_end = heads * d, (heads + kv) * d
    expected_q, expected_k = apply_rotary(qkv[:, :q_end].view(t, heads, d), qkv[:, q_end:k_end].view(t, kv, d), cos,
                                          sin)  # PyTorch path (fixture)
    v_before = qkv[:, k_end:].clone()
    kernels.rotary_(qkv[:, :k_end].view(t, heads + kv, d), cos, sin)
    assert_matches_rounding(qkv[:, :q_end].view(t, heads, d), expected_q)
    assert_matches_rounding(qkv[:, q_end:k_end].view(t, kv, d), expected_k)
    assert torch.equal(qkv[:, k_end:], v_before)  # v columns untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_rotary_kernels_match_the_torch_path(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers' kernel path (default here) against their PyTorch path on the same inputs."""
    from tandem.models import layers

    g = gen(7)
    norm = RMSNorm(896, 1e-6, dtype)
    norm.weight.data.copy_(1 + 0.3 * torch.randn(896, generator=g))
    x = (3 * torch.randn(3, 896, generator=g)).to(dtype)
    qk = torch.randn(3, 16, 64, generator=g).to(dtype)
    angles = torch.rand(3, 1, 32, generator=g) * 100
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    fast_norm, fast_rot = norm(x), layers.apply_rotary_(qk.clone(), cos, sin)
    monkeypatch.setattr(layers, "_use_kernels", lambda *args: False)
    assert_matches_rounding(fast_norm, norm(x))
    assert_matches_rounding(fast_rot, layers.apply_rotary_(qk.clone(), cos, sin))
