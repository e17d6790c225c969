"""Sliding-window attention and score soft-capping over the paged cache, against a dense float64 reference.

The reference (``dense_window``) is written here from the definition: query position p attends to keys
``max(0, p - window + 1) .. p`` with scores ``c tanh(s / c)`` (``s = scale q.k``), softmax, times V. It
checks ``TorchRefAttention`` (the oracle), the avx2 kernel (``paged_attention_ex``; fp32 within 1e-5,
bf16 within one bf16 rounding), and ``CpuPagedAttention`` on both of its routes (kernel, and the PyTorch
route it takes where the kernel lacks the window). Batch invariance: a query's output has the same bits
alone, among the queries of a chunk, and after a prefix-cache hit, with a window.
"""

from __future__ import annotations

import pytest
import torch

from tandem import kernels
from tandem.attention import AttentionMetadata, CpuPagedAttention, TorchRefAttention
from tandem.attention.torch_ref import write_kv_cache
from tandem.kernels import build
from tests.unit.test_kernels import gen, make_step

EX_VARIANTS = [v for v in build.VARIANTS if hasattr(build.load_variant(v) or object(), "paged_attention_ex")]
on_ex_variants = pytest.mark.parametrize(
    "variant", EX_VARIANTS or [pytest.param(None, marks=pytest.mark.skip(reason="no variant has paged_attention_ex"))]
)
CASES = [(1, 0.0), (5, 0.0), (8, 2.0), (16, 0.0), (33, 1.5), (0, 3.0)]  # (window, softcap); 0 = none


def dense_window(q, k, v, meta: AttentionMetadata, k_cache, v_cache, scale: float, window: int,  # noqa: ANN001
                 softcap: float) -> torch.Tensor:
    """float64 ``[T, H, D]`` from the definition, one query at a time (reads the written caches)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    block = k_cache.shape[1]
    for r, seq_len in enumerate(lens):
        table = meta.block_tables[r].tolist()
        slots = [table[j // block] * block + j % block for j in range(seq_len)]
        keys = k_cache.reshape(-1, *k_cache.shape[2:])[slots].double()
        values = v_cache.reshape(-1, *v_cache.shape[2:])[slots].double()
        n = starts[r + 1] - starts[r]
        for i in range(n):
            p = seq_len - n + i
            lo = 0 if window == 0 else max(0, p - window + 1)
            for h in range(q.shape[1]):
                s = keys[lo : p + 1, h // group] @ q[starts[r] + i, h].double() * scale
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                out[starts[r] + i, h] = torch.softmax(s, 0) @ values[lo : p + 1, h // group]
    return out


def _step(dtype: torch.dtype, seed: int, heads: int = 6, kv: int = 2, d: int = 24, block: int = 4):
    return make_step(heads, kv, d, block, dtype, seed)


@pytest.mark.parametrize(("window", "softcap"), CASES)
def test_torch_ref_window_and_softcap_match_the_definition(window: int, softcap: float) -> None:
    q, k, v, (kc, vc), meta = _step(torch.float64, seed=window)
    out = TorchRefAttention()(q, k, v, kc, vc, meta, 0.3, window or None, softcap or None)
    torch.testing.assert_close(out, dense_window(q, k, v, meta, kc, vc, 0.3, window, softcap), rtol=1e-10, atol=1e-10)


@on_ex_variants
@pytest.mark.parametrize(("window", "softcap"), CASES)
@pytest.mark.parametrize(("dtype", "block"), [(torch.float32, 4), (torch.bfloat16, 16), (torch.float32, 5)])
def test_kernel_window_and_softcap_match_the_definition(variant: str, window: int, softcap: float,
                                                        dtype: torch.dtype, block: int) -> None:
    q, k, v, (kc, vc), meta = _step(dtype, seed=window + block, block=block)
    out = torch.full_like(q, float("nan"))
    build.load_variant(variant).paged_attention_ex(out, q, k, v, kc, vc, meta.slot_mapping, meta.block_tables,
                                                   meta.seq_lens, meta.query_start_loc, 0.3, 1 << 30, window, softcap)
    expected = dense_window(q, k, v, meta, kc, vc, 0.3, window, softcap)
    err = (out.double() - expected).abs()
    rel = 1e-5 if dtype == torch.float32 else 2**-8
    assert (err <= rel * expected.abs() + 1e-5).all(), err.max()


@pytest.mark.parametrize("kernel_has_window", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_paged_backend_window_on_both_routes(kernel_has_window: bool, dtype: torch.dtype,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Short rows by the kernel (or, without ``paged_attention_ex``, every row by PyTorch); long rows by SDPA."""
    if kernel_has_window and not kernels.supports_window_softcap():
        pytest.skip(f"the {kernels.backend()} kernels have no sliding window")
    if not kernels.available("paged_attention"):
        pytest.skip(f"no paged_attention kernel: {kernels.unavailable_reason('paged_attention')}")
    monkeypatch.setattr(kernels, "supports_window_softcap", lambda: kernel_has_window)
    for window, softcap in ((6, 0.0), (3, 2.0), (64, 0.0)):  # 64: wider than every row, dropped
        q, k, v, (kc, vc), meta = _step(dtype, seed=40 + window)
        out = CpuPagedAttention(max_query_len=2)(q, k, v, kc, vc, meta, 0.3, window, softcap or None)
        expected = dense_window(q, k, v, meta, kc, vc, 0.3, window, softcap)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


def _row(full: tuple[torch.Tensor, ...], block: int, computed: int, end: int, window: int) -> torch.Tensor:
    """Tokens ``computed .. end - 1`` of ``full`` (q, k, v ``[S, *, D]``) as one step's row after a cached prefix."""
    q, k, v = full
    blocks = -(-q.shape[0] // block)
    caches = tuple(torch.zeros(blocks, block, *k.shape[1:], dtype=q.dtype) for _ in range(2))
    table = torch.randperm(blocks, generator=gen(blocks)).tolist()
    if computed:
        write_kv_cache(k[:computed], v[:computed], *caches,
                       AttentionMetadata.build([0], [computed], [table], block).slot_mapping)
    meta = AttentionMetadata.build([computed], [end - computed], [table], block)
    out = torch.full_like(q[computed:end], float("nan"))
    kernels.paged_attention(out, q[computed:end], k[computed:end], v[computed:end], *caches, meta.slot_mapping,
                            meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.2, 1 << 30, window, 2.0)
    return out


@pytest.mark.skipif(not kernels.supports_window_softcap(), reason="the loaded kernels have no sliding window")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_window_is_batch_invariant(dtype: torch.dtype) -> None:
    """With window 21 (crossing 16-key chunks and blocks of 16): decode == inside a 120-token prompt ==
    among 5 speculative queries == after a prefix-cache hit, bit for bit."""
    g = gen(7)
    full = tuple(torch.randn(120, h, 32, generator=g).to(dtype) for h in (4, 2, 2))
    prefill = _row(full, 16, 0, 120, 21)
    assert torch.equal(_row(full, 16, 64, 120, 21), prefill[64:])
    for pos in (0, 20, 21, 37, 48, 119):
        assert torch.equal(_row(full, 16, pos, pos + 1, 21)[0], prefill[pos]), pos
        first = max(pos - 3, 0)
        assert torch.equal(_row(full, 16, first, min(first + 5, 120), 21)[pos - first], prefill[pos]), pos


@pytest.mark.parametrize("route", ["torch_ref", "kernel", "cpu_paged_torch"])
def test_blocks_before_the_window_are_not_read(route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cache blocks wholly before every query's window are NaN: the outputs stay finite and exact (so
    such blocks could be freed or reused)."""
    if route != "torch_ref" and not kernels.available("paged_attention"):
        pytest.skip(f"no paged_attention kernel: {kernels.unavailable_reason('paged_attention')}")
    if route == "kernel" and not kernels.supports_window_softcap():
        pytest.skip(f"the {kernels.backend()} kernels have no sliding window")
    monkeypatch.setattr(kernels, "supports_window_softcap", lambda: route == "kernel")
    window = 5
    q, k, v, (kc, vc), meta = _step(torch.float32, seed=3)
    write_kv_cache(k, v, kc, vc, meta.slot_mapping)  # as the backend will (again)
    expected = dense_window(q, k, v, meta, kc, vc, 0.3, window, 0.0)
    block = kc.shape[1]
    poisoned = 0
    for r, computed in enumerate(meta.num_computed.tolist()):
        first_key = max(0, computed - window + 1)
        for b in meta.block_tables[r, : first_key // block].tolist():
            kc[b], vc[b] = float("nan"), float("nan")
            poisoned += 1
    assert poisoned >= 5  # the 37- and 9-token rows' early blocks
    backend = TorchRefAttention() if route == "torch_ref" else CpuPagedAttention(max_query_len=2)
    out = backend(q, k, v, kc, vc, meta, 0.3, window)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel_has_window", [True, False])
def test_cpu_paged_row_route_does_not_depend_on_the_batch(kernel_has_window: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1-query row whose context fits in the window has the same bits alone and beside a row that
    exceeds it (which turns the window on for the step), on both routes (and without the windowed
    kernel, the short row stays on the plain kernel)."""
    if not kernels.available("paged_attention"):
        pytest.skip(f"no paged_attention kernel: {kernels.unavailable_reason('paged_attention')}")
    if kernel_has_window and not kernels.supports_window_softcap():
        pytest.skip(f"the {kernels.backend()} kernels have no sliding window")
    monkeypatch.setattr(kernels, "supports_window_softcap", lambda: kernel_has_window)
    g = gen(11)
    # float32: no output rounding hides a different route
    full = [tuple(torch.randn(n, h, 16, generator=g) for h in (4, 2, 2)) for n in (6, 30)]

    def step(rows: list[int]) -> torch.Tensor:
        caches = tuple(torch.zeros(16, 4, 2, 16) for _ in range(2))
        tables = [[0, 1], [2, 3, 4, 5, 6, 7, 8, 9]]
        lens = [full[r][0].shape[0] for r in rows]
        write = AttentionMetadata.build([0] * len(rows), [n - 1 for n in lens], [tables[r] for r in rows], 4)
        write_kv_cache(torch.cat([full[r][1][:-1] for r in rows]), torch.cat([full[r][2][:-1] for r in rows]),
                       *caches, write.slot_mapping)
        meta = AttentionMetadata.build([n - 1 for n in lens], [1] * len(rows), [tables[r] for r in rows], 4)
        q, k, v = (torch.cat([full[r][i][-1:] for r in rows]) for i in range(3))
        return CpuPagedAttention(max_query_len=2)(q, k, v, *caches, meta, 0.25, 8)

    assert torch.equal(step([0]), step([0, 1])[:1])
