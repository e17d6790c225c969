"""Tandem's C++ CPU kernels against independent PyTorch references, on every variant this CPU runs.

Each test of a kernel is parametrized over ``RUNNABLE`` (the variants of ``tandem.kernels.build``
this CPU can run: ``avx2`` on every x86-64 server since Haswell / Zen 1, ``avx512_bf16`` too on
Zen 4 / Sapphire Rapids) and calls that variant's function directly. References:
  paged_attention  ``TorchRefAttention`` (the oracle: gather + SDPA) in float64. fp32: 1e-5
                   (exp polynomial < 2e-7 relative, fp32 summation); bf16: the inputs are exact in
                   float64, so one bf16 rounding of the output (2^-8 relative) plus fp32 error.
                   The caches must equal the reference's bit for bit. Batch invariance: a query's
                   output is bit-identical alone, among 5 queries of its row, in a 200-token prompt
                   row, after a prefix-cache hit, and beside other rows.
  rms_norm, fused_add_rms_norm, rotary, rotary_, silu_and_mul: the layers' PyTorch code with the
                   kernels disabled (``torch_layers``), whose intermediate bf16 roundings the kernels
                   reproduce: equal except where an fp32 last-bit difference (summation order, exp
                   polynomial) flips a bf16 rounding (<= 1 bf16 ulp, on under 2% of elements); fp32
                   within 1e-6 relative.
The linear kernels are tested in test_kernels_linear.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tandem import kernels
from tandem.attention import AttentionMetadata, CpuPagedAttention, TorchRefAttention, cpu_paged, select_backend
from tandem.attention.torch_ref import write_kv_cache
from tandem.kernels import build
from tandem.models import layers
from tandem.models.layers import RMSNorm, SiluAndMul, apply_rotary

RUNNABLE = [v for v in build.VARIANTS if build.load_variant(v) is not None]
VARIANTS = RUNNABLE or [pytest.param(None, marks=pytest.mark.skip(reason="no kernel variant runs on this CPU"))]
on_every_variant = pytest.mark.parametrize("variant", VARIANTS)


def kernel(variant: str, op: str) -> Callable:
    """Function ``op`` of one variant's module; skips when that variant does not have it."""
    module = build.load_variant(variant)
    if not hasattr(module, op):
        pytest.skip(f"the {variant} kernels have no {op}")
    return getattr(module, op)


@pytest.fixture
def torch_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the layers in tandem.models.layers take their PyTorch path (the kernels' oracle)."""
    monkeypatch.setattr(layers, "_use_kernels", lambda *args: False)


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


def call_kernel(variant: str, q, k, v, caches, meta: AttentionMetadata, scale: float,  # noqa: ANN001
                max_query_len: int = 1 << 30) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))
    kernel(variant, "paged_attention")(out, q, k, v, caches[0], caches[1], meta.slot_mapping, meta.block_tables,
                                       meta.seq_lens, meta.query_start_loc, scale, max_query_len)
    return out


@on_every_variant
@pytest.mark.parametrize(("heads", "kv", "d", "block"), [(4, 2, 8, 4), (14, 2, 64, 16), (8, 8, 80, 16),
                                                         (6, 2, 128, 32), (7, 1, 24, 5), (2, 1, 256, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_float64_reference(variant: str, heads: int, kv: int, d: int, block: int,
                                                   dtype: torch.dtype) -> None:
    q, k, v, (kc, vc), meta = make_step(heads, kv, d, block, dtype, seed=heads * d + block)
    scale = d**-0.5
    ref_kc, ref_vc = kc.double(), vc.double()
    expected = TorchRefAttention()(q.double(), k.double(), v.double(), ref_kc, ref_vc, meta, scale)
    out = call_kernel(variant, q, k, v, (kc, vc), meta, scale)
    assert torch.equal(kc.double(), ref_kc) and torch.equal(vc.double(), ref_vc)
    err = (out.double() - expected).abs()
    if dtype == torch.float32:
        assert (err <= 1e-5 * expected.abs() + 1e-5).all()
    else:
        assert (err <= 2**-8 * expected.abs() + 1e-5).all()


@on_every_variant
def test_paged_attention_leaves_long_rows_and_reads_strided_views(variant: str) -> None:
    heads, kv, d = 4, 2, 16
    q, k, v, (kc, vc), meta = make_step(heads, kv, d, 4, torch.float32, seed=3)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)  # a fused projection's output
    qv, kv_, vv = qkv.split([heads * d, kv * d, kv * d], dim=1)
    qv, kv_, vv = qv.view(-1, heads, d), kv_.view(-1, kv, d), vv.view(-1, kv, d)
    expected = TorchRefAttention()(q.double(), k.double(), v.double(), kc.double(), vc.double(), meta, 0.25)
    out = call_kernel(variant, qv, kv_, vv, (kc, vc), meta, 0.25, max_query_len=2)
    starts = meta.query_start_loc.tolist()
    for r in range(meta.num_reqs):
        rows = slice(starts[r], starts[r + 1])
        if starts[r + 1] - starts[r] <= 2:
            torch.testing.assert_close(out[rows].double(), expected[rows], rtol=1e-5, atol=1e-5)
        else:
            assert out[rows].isnan().all()


def attend_row(variant: str, full: tuple[torch.Tensor, ...], block: int, computed: int, end: int,
               other: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """Outputs ``[end - computed, H, D]`` of tokens ``computed .. end - 1`` of one sequence ``full`` (q, k, v
    ``[S, *, D]``) as one row of a step, its first ``computed`` keys written into the cache by an earlier
    step; ``other`` (q, k, v of a 3-token prompt) adds a second row to the step."""
    q, k, v = full
    kv, d = k.shape[1:]
    blocks = -(-q.shape[0] // block)
    caches = tuple(torch.zeros(blocks + 2, block, kv, d, dtype=q.dtype) for _ in range(2))
    table = torch.randperm(blocks, generator=gen(blocks)).tolist()  # shuffled block ids
    if computed:
        write_kv_cache(k[:computed], v[:computed], *caches, AttentionMetadata.build([0], [computed], [table],
                                                                                     block).slot_mapping)
    rows = ([computed], [end - computed], [table])
    step = [t[computed:end] for t in full]
    if other is not None:
        rows = ([computed, 0], [end - computed, 3], [table, [blocks, blocks + 1][: -(-3 // block)]])
        step = [torch.cat([a, b]) for a, b in zip(step, other, strict=True)]
    out = call_kernel(variant, *step, caches, AttentionMetadata.build(*rows, block), q.shape[-1] ** -0.5)
    return out[: end - computed]


@on_every_variant
@pytest.mark.parametrize(("heads", "kv", "d", "block"), [(6, 2, 64, 16), (7, 1, 24, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_is_batch_invariant(variant: str, heads: int, kv: int, d: int, block: int,
                                            dtype: torch.dtype) -> None:
    """A query's output has the same bits alone (decode), as one of 5 queries of its row (speculative
    verification), inside a 200-token prompt row, in a chunk after a prefix-cache hit, beside another row."""
    g = gen(heads + d)
    full = tuple(torch.randn(200, h, d, generator=g).to(dtype) for h in (heads, kv, kv))
    other = tuple(t[:3].flip(0) for t in full)
    prefill = attend_row(variant, full, block, 0, 200)
    after_prefix_hit = attend_row(variant, full, block, 128, 200)
    assert torch.equal(after_prefix_hit, prefill[128:])
    for pos in (0, 4, 15, 16, 17, 99, 130, 199):
        assert torch.equal(attend_row(variant, full, block, pos, pos + 1)[0], prefill[pos]), pos
        assert torch.equal(attend_row(variant, full, block, pos, pos + 1, other)[0], prefill[pos]), pos
        first = max(pos - 2, 0)
        assert torch.equal(attend_row(variant, full, block, first, min(first + 5, 200))[pos - first], prefill[pos])


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


@pytest.mark.skipif(kernels.backend() not in ("avx2", "avx512_bf16"), reason="no paged_attention kernel selected")
def test_cpu_paged_backend_attends_every_row_with_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt rows too (batch invariance on both variants): no SDPA, the kernel's bits."""
    monkeypatch.setattr(cpu_paged.F, "scaled_dot_product_attention", lambda *a, **k: pytest.fail("SDPA used"))
    q, k, v, caches, meta = make_step(8, 2, 64, 16, torch.bfloat16, seed=6)
    kernel_caches = [c.clone() for c in caches]
    out = CpuPagedAttention()(q, k, v, *caches, meta, 0.125)
    assert torch.equal(out, call_kernel(kernels.backend(), q, k, v, kernel_caches, meta, 0.125))


def test_select_backend() -> None:
    if not kernels.available("paged_attention"):
        pytest.skip(f"no paged_attention kernel: {kernels.unavailable_reason('paged_attention')}")
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


def rope_inputs(t: int, d: int, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(t, 1, d // 2, generator=g) * 100
    return tuple(torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))


@on_every_variant
@pytest.mark.parametrize("dim", [8, 17, 64, 896])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_torch_path(variant: str, dim: int, dtype: torch.dtype, torch_layers: None) -> None:
    g = gen(dim)
    norm = RMSNorm(dim, 1e-6, dtype)
    norm.weight.data.copy_(1 + 0.3 * torch.randn(dim, generator=g))
    x = (3 * torch.randn(5, dim, generator=g)).to(dtype)
    assert_matches_rounding(kernel(variant, "rms_norm")(x, norm.weight, 1e-6), norm(x))


@on_every_variant
@pytest.mark.parametrize("dim", [8, 17, 64, 896])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_matches_add_then_norm(variant: str, dim: int, dtype: torch.dtype,
                                                  torch_layers: None) -> None:
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
    kernel(variant, "fused_add_rms_norm")(x, residual, norm.weight, 1e-6)
    assert torch.equal(residual, expected_residual)
    assert_matches_rounding(x, expected)


@on_every_variant
def test_fused_add_rms_norm_rejects_bad_layouts(variant: str) -> None:
    fused_add_rms_norm = kernel(variant, "fused_add_rms_norm")
    w = torch.ones(8, dtype=torch.bfloat16)
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="contiguous"):
        fused_add_rms_norm(torch.zeros(8, 4, dtype=torch.bfloat16).t(), x, w, 1e-6)
    with pytest.raises(RuntimeError, match="dtype"):
        fused_add_rms_norm(x, x.float(), w, 1e-6)
    with pytest.raises(RuntimeError, match=r"\[R, dim\]"):
        fused_add_rms_norm(x, torch.zeros(3, 8, dtype=torch.bfloat16), w, 1e-6)


@on_every_variant
@pytest.mark.parametrize(("heads", "d"), [(4, 8), (14, 64), (3, 34), (2, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_torch_path(variant: str, heads: int, d: int, dtype: torch.dtype, torch_layers: None) -> None:
    g = gen(heads * d)
    t = 6
    qk = torch.randn(t, 2 * heads * d, generator=g).to(dtype)
    x = qk[:, : heads * d].view(t, heads, d)  # a strided view, as from a fused projection
    cos, sin = rope_inputs(t, d, dtype, g)
    expected, _ = apply_rotary(x, x, cos, sin)  # PyTorch path (fixture)
    assert_matches_rounding(kernel(variant, "rotary")(x, cos, sin), expected)


@on_every_variant
@pytest.mark.parametrize(("heads", "kv", "d"), [(4, 2, 8), (14, 2, 64), (3, 1, 34), (2, 2, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_fused_qkv_matches_torch_path(variant: str, heads: int, kv: int, d: int,
                                                         dtype: torch.dtype, torch_layers: None) -> None:
    g = gen(heads * d + kv)
    t = 5
    qkv = torch.randn(t, (heads + 2 * kv) * d, generator=g).to(dtype)
    cos, sin = rope_inputs(t, d, dtype, g)
    q_end, k_end = heads * d, (heads + kv) * d
    expected_q, expected_k = apply_rotary(qkv[:, :q_end].view(t, heads, d), qkv[:, q_end:k_end].view(t, kv, d), cos,
                                          sin)  # PyTorch path (fixture)
    v_before = qkv[:, k_end:].clone()
    kernel(variant, "rotary_")(qkv[:, :k_end].view(t, heads + kv, d), cos, sin)
    assert_matches_rounding(qkv[:, :q_end].view(t, heads, d), expected_q)
    assert_matches_rounding(qkv[:, q_end:k_end].view(t, kv, d), expected_k)
    assert torch.equal(qkv[:, k_end:], v_before)  # v columns untouched


@on_every_variant
@pytest.mark.parametrize("d", [1, 17, 172, 4864])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_torch_path(variant: str, d: int, dtype: torch.dtype, torch_layers: None) -> None:
    x = (4 * torch.randn(3, 2 * d, generator=gen(d))).to(dtype)
    assert_matches_rounding(kernel(variant, "silu_and_mul")(x), SiluAndMul()(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_kernel_path_matches_their_torch_path(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers' kernel path (the selected variant) against their PyTorch path on the same inputs."""
    if not kernels.available("rms_norm"):
        pytest.skip(f"no rms_norm kernel: {kernels.unavailable_reason('rms_norm')}")
    g = gen(7)
    norm = RMSNorm(896, 1e-6, dtype)
    norm.weight.data.copy_(1 + 0.3 * torch.randn(896, generator=g))
    x = (3 * torch.randn(3, 896, generator=g)).to(dtype)
    gate_up = (4 * torch.randn(3, 2 * 172, generator=g)).to(dtype)
    qk = torch.randn(3, 16, 64, generator=g).to(dtype)
    cos, sin = rope_inputs(3, 64, dtype, g)
    fast = norm(x), layers.apply_rotary_(qk.clone(), cos, sin), SiluAndMul()(gate_up)
    monkeypatch.setattr(layers, "_use_kernels", lambda *args: False)
    slow = norm(x), layers.apply_rotary_(qk.clone(), cos, sin), SiluAndMul()(gate_up)
    for a, b in zip(fast, slow, strict=True):
        assert_matches_rounding(a, b)
