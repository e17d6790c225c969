"""The model runner's paged KV cache: per-layer K/V tensors of the target (and draft) model, and
copies of given blocks in and out of them (``kv_cache/transfer.py``). ``ModelRunner`` inherits it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from tandem.kv_cache import transfer
from tandem.kv_cache.storage import bytes_per_block, check_kv_memory, kv_cache_shape
from tandem.models.hf_config import HFModelConfig
from tandem.models.llama import KVCache

if TYPE_CHECKING:
    from tandem.spec_decode.speculator import Speculator

logger = logging.getLogger("tandem.worker.model_runner")  # NOTE: the name it always logged under


class RunnerKVCache:
    """``ModelRunner``'s KV cache methods; the attributes below are set by ``ModelRunner.__init__``."""

    hf_config: HFModelConfig
    dtype: torch.dtype
    dtype_bytes: int
    block_size: int
    speculator: Speculator | None
    kv_caches: list[KVCache]
    num_blocks: int

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one KV block of ``block_size`` tokens takes across all layers (K and V)."""
        hf = self.hf_config
        return bytes_per_block(block_size, hf.num_layers, hf.num_kv_heads, hf.head_dim, self.dtype_bytes)

    @property
    def kv_window(self) -> int | None:
        """Tokens of a request's KV any future query can still read when every layer of the target (and
        of the draft model, which shares the block table) slides: the largest window; None when some
        layer attends to the whole context (then no block can be freed before the request ends)."""
        windows = [self.hf_config.kv_window]
        draft = self.speculator.draft if self.speculator is not None else None
        if draft is not None:
            windows.append(draft.hf_config.kv_window)
        return None if None in windows else max(w for w in windows if w is not None)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate zeroed per-layer ``k_cache, v_cache [num_blocks, block_size, KV, D]`` (model dtype),
        and the draft model's cache on the same block ids.

        Changes: replaces ``kv_caches`` and ``num_blocks`` (any cached K/V is dropped).

        Raises:
            ConfigError: target + draft caches (zero-filled, so all resident) exceed
                ``storage.KV_MEMORY_FRACTION`` of the memory available now (``storage.check_kv_memory``).
        """
        draft_bytes = self.speculator.kv_cache_bytes_per_block() if self.speculator is not None else 0
        needed = check_kv_memory(num_blocks, self.kv_cache_bytes_per_block(self.block_size) + draft_bytes)
        self.kv_caches = self._allocate_kv(num_blocks)
        self.num_blocks = num_blocks
        if self.speculator is not None:
            self.speculator.initialize_kv_cache(num_blocks)
        logger.info("KV cache: %d blocks, %.3f GiB (target + draft)", num_blocks, needed / (1 << 30))

    def kv_cache_groups(self) -> list[list[KVCache]]:
        """The paged caches per model: the target's per-layer ``(k, v)``, then the draft model's (if
        any), each ``[num_blocks, block_size, kv_heads, head_dim]``. The tensors themselves (a KV
        transfer writes into them); changes nothing."""
        caches = [self.kv_caches]
        draft = self.speculator.draft if self.speculator is not None else None
        if draft is not None:
            caches.append(draft.kv_caches)
        return caches

    def read_kv_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Copies of the KV of ``block_ids``: the target's buffer, then the draft model's (if any).

        Each buffer is ``[num_layers, 2 (K, V), len(block_ids), block_size, num_kv_heads, head_dim]``
        of that model, in its cache dtype, contiguous (``kv_cache/transfer.py``). Changes nothing.
        Raises:
            ValueError: the KV cache is not initialized, or a block id is outside it.
        """
        return [transfer.read_blocks(caches, block_ids) for caches in self.kv_cache_groups()]

    def write_kv_blocks(self, block_ids: list[int], buffers: list[torch.Tensor]) -> None:
        """Writes buffers shaped as ``read_kv_blocks`` returns into ``block_ids`` (target, then draft).

        Changes: those blocks' K/V in every layer of each cache.
        Raises:
            ValueError: not one buffer per cache, a shape mismatch, or a bad block id.
        """
        caches = self.kv_cache_groups()
        if len(buffers) != len(caches):
            raise ValueError(f"{len(buffers)} KV buffers for {len(caches)} caches (target, then draft)")
        for cache, buffer in zip(caches, buffers, strict=True):
            transfer.write_blocks(cache, block_ids, buffer)

    def _allocate_kv(self, num_blocks: int) -> list[KVCache]:
        hf = self.hf_config
        shape = kv_cache_shape(num_blocks, self.block_size, hf.num_kv_heads, hf.head_dim)
        return [
            (torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype))
            for _ in range(hf.num_layers)
        ]
