"""``kv_cache/transfer.py``'s one-thread row copies (the KV transfer's reads and writes of non-consecutive
blocks) against torch's ``index_select`` / ``index_copy_``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.kv_cache.transfer import as_rows, write_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_read_and_write_as_index_select_and_index_copy(dtype):
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(9, 4, 2, 8, generator=gen).to(dtype)  # [num_blocks, block_size, kv_heads, head_dim]
    ids = [5, 2, 7]
    picked = as_rows(cache)[np.asarray(ids)]
    assert picked.shape == (3, 4 * 2 * 8 * cache.element_size())
    read = torch.from_numpy(picked.copy()).view(dtype).view(3, 4, 2, 8)
    assert torch.equal(read, cache.index_select(0, torch.tensor(ids)))
    rows = torch.randn(3, 4, 2, 8, generator=gen).to(dtype)
    expected = cache.clone().index_copy_(0, torch.tensor(ids), rows)
    write_rows(cache, np.asarray(ids), rows)
    assert torch.equal(cache, expected)
    strided = torch.zeros(4, 9, 2, 8, dtype=dtype).transpose(0, 1)  # not contiguous: torch's own copy
    write_rows(strided, np.asarray(ids), rows)
    assert torch.equal(strided[ids], rows)
