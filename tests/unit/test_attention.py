"""Reference paged attention vs dense causal SDPA; metadata (slot mapping, positions) by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.attention import AttentionMetadata, TorchRefAttention, token_positions
from tandem.attention.torch_ref import write_kv_cache

NUM_HEADS, NUM_KV, HEAD_DIM, BLOCK = 4, 2, 8, 4


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``q [S, H, D]``, ``k, v [S, KV, D]`` -> ``[S, H, D]``, KV heads repeated for GQA."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)


def test_metadata_slots_positions_and_offsets() -> None:
    meta = AttentionMetadata.build(
        num_computed=[5, 0], num_scheduled=[2, 3], block_ids=[[7, 2], [4]], block_size=4
    )
    # row 0: positions 5, 6 -> block 2 (index 1), offsets 1, 2; row 1: positions 0..2 in block 4.
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 2 * 4 + 2, 16, 17, 18]
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.query_start_loc.tolist() == [0, 2, 5] and meta.query_start_loc.dtype == torch.int32
    assert meta.seq_lens.tolist() == [7, 3]
    assert meta.block_tables.tolist() == [[7, 2], [4, 0]] and meta.block_tables.dtype == torch.int32
    assert meta.num_computed.tolist() == [5, 0]
    assert token_positions(torch.tensor([5, 0]), torch.tensor([2, 3])).tolist() == [5, 6, 0, 1, 2]


def test_metadata_rejects_short_block_table() -> None:
    with pytest.raises(ValueError, match="row 0: 1 blocks of 4 tokens cannot hold 5 tokens"):
        AttentionMetadata.build([4], [1], [[3]], 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_matches_dense_causal(dtype: torch.dtype) -> None:
    """Several requests, different lengths and cached prefixes (prefill, chunk, decode), shuffled blocks."""
    gen = torch.Generator().manual_seed(0)
    seq_lens = [9, 1, 17, 6, 12]
    computed = [0, 0, 10, 5, 4]  # full prefill, 1-token prompt, chunk after a prefix, decode, chunk
    num_blocks = 32
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-n // BLOCK))] for n in seq_lens]
    k_cache = torch.zeros(num_blocks, BLOCK, NUM_KV, HEAD_DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    full = [
        tuple(torch.randn(n, h, HEAD_DIM, generator=gen).to(dtype) for h in (NUM_HEADS, NUM_KV, NUM_KV))
        for n in seq_lens
    ]
    # The cached prefixes were written by earlier steps.
    prefix = AttentionMetadata.build([0] * len(seq_lens), computed, tables, BLOCK)
    write_kv_cache(
        torch.cat([k[:c] for (_, k, _), c in zip(full, computed, strict=True)]),
        torch.cat([v[:c] for (_, _, v), c in zip(full, computed, strict=True)]),
        k_cache, v_cache, prefix.slot_mapping,
    )
    new = [n - c for n, c in zip(seq_lens, computed, strict=True)]
    meta = AttentionMetadata.build(computed, new, tables, BLOCK)
    q, k, v = (torch.cat([t[i][c:] for t, c in zip(full, computed, strict=True)]) for i in range(3))
    out = TorchRefAttention()(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    starts = meta.query_start_loc.tolist()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for r, (fq, fk, fv) in enumerate(full):
        expected = dense_causal(fq.float(), fk.float(), fv.float())[computed[r] :]
        torch.testing.assert_close(out[starts[r] : starts[r + 1]].float(), expected, atol=tol, rtol=tol)


def test_write_kv_cache_places_tokens_at_slots() -> None:
    k_cache = torch.zeros(3, 2, 1, 1)
    v_cache = torch.zeros(3, 2, 1, 1)
    k = torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1)
    write_kv_cache(k, -k, k_cache, v_cache, torch.tensor([5, 0, 2]))
    assert k_cache.flatten().tolist() == [2.0, 0.0, 3.0, 0.0, 0.0, 1.0]
    assert v_cache.flatten().tolist() == [-2.0, 0.0, -3.0, 0.0, 0.0, -1.0]
