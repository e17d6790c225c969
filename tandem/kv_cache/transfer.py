"""Copying the KV of given blocks out of and into a model's paged cache, as one contiguous buffer.

The worker half of a KV transfer (a P/D connector, a test round trip). A cache is one ``(k_cache,
v_cache)`` pair per layer, each ``[num_blocks, block_size, num_kv_heads, head_dim]``. A buffer of
``n`` blocks is ``[num_layers, 2, n, block_size, num_kv_heads, head_dim]`` (axis 1: K then V) in
the cache dtype, contiguous, blocks in the order of the ids given. Unlike the rest of ``kv_cache``
this module touches tensors, and is used by the model runner only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

KVCachePair = tuple[torch.Tensor, torch.Tensor]


def _index(block_ids: Sequence[int], num_blocks: int) -> torch.Tensor:
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"block ids {bad} are outside the cache's {num_blocks} blocks")
    return torch.tensor(list(block_ids), dtype=torch.int64)


def read_blocks(kv_caches: Sequence[KVCachePair], block_ids: Sequence[int]) -> torch.Tensor:
    """A copy of the blocks' K/V: ``[num_layers, 2, len(block_ids), block_size, kv_heads, head_dim]``.

    Changes nothing. Raises ValueError: a block id outside the cache, or an empty cache list.
    """
    if not kv_caches:
        raise ValueError("no KV cache to read (initialize_kv_cache first)")
    index = _index(block_ids, kv_caches[0][0].shape[0])
    return torch.stack([torch.stack((k.index_select(0, index), v.index_select(0, index))) for k, v in kv_caches])


def write_blocks(kv_caches: Sequence[KVCachePair], block_ids: Sequence[int], buffer: torch.Tensor) -> None:
    """Writes ``buffer`` (shaped as ``read_blocks`` returns, any dtype castable) into the blocks.

    Changes: the cache contents of those blocks in every layer (K and V).
    Raises:
        ValueError: a block id outside the cache, repeated ids, or a buffer shape that does not match
            ``[num_layers, 2, len(block_ids), block_size, kv_heads, head_dim]``.
    """
    if not kv_caches:
        raise ValueError("no KV cache to write (initialize_kv_cache first)")
    if len(set(block_ids)) != len(block_ids):
        raise ValueError(f"block ids repeat: {list(block_ids)}")
    k0 = kv_caches[0][0]
    expected = (len(kv_caches), 2, len(block_ids), *k0.shape[1:])
    if tuple(buffer.shape) != expected:
        raise ValueError(f"KV buffer of shape {tuple(buffer.shape)} does not match {expected}")
    index = _index(block_ids, k0.shape[0])
    for layer, (k, v) in enumerate(kv_caches):
        k.index_copy_(0, index, buffer[layer, 0].to(k.dtype))
        v.index_copy_(0, index, buffer[layer, 1].to(v.dtype))


def as_rows(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's bytes as a ``[dim 0, bytes per row]`` uint8 array sharing its memory (any dtype)."""
    return tensor.view(torch.uint8).numpy().reshape(tensor.shape[0], -1)


def write_rows(cache: torch.Tensor, index: np.ndarray, rows: torch.Tensor) -> None:
    """``cache[index] = rows`` along dim 0 with numpy, on this thread only.

    NOTE: torch's parallel copy (``index_copy_``) ran at 0.04 GB/s on a loaded 2-core machine (its OpenMP
    threads wait for busy cores) against 20 GB/s for one thread; a transfer thread must not use the pool.
    """
    if not cache.is_contiguous():
        cache.index_copy_(0, torch.from_numpy(index), rows)
        return
    as_rows(cache)[index] = as_rows(rows)
