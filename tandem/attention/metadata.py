"""Per-step attention metadata for one flattened ragged batch, and the backend protocol."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the paged KV cache and what each request attends to.

    A step holds R requests (rows) whose new tokens are concatenated into T tokens; row r owns
    tokens ``query_start_loc[r] : query_start_loc[r + 1]`` at positions ``num_computed[r] + i``.

    Fields:
        slot_mapping: ``[T]`` int64, cache slot of each new token (``block_id * block_size + offset``).
        query_start_loc: ``[R + 1]`` int32, cumulative new-token counts (starts at 0).
        seq_lens: ``[R]`` int32, context length of each row including this step's tokens.
        block_tables: ``[R, max_blocks]`` int32, each row's block ids, padded with 0; also 0 where the
            scheduler's table has a negative id (``kv_cache.manager.SKIPPED_BLOCK_ID``: a block freed
            because it is out of every layer's sliding window), so a kernel that reads such an entry
            before masking it still reads inside the cache.
        num_computed: ``[R]`` int32, tokens of each row already in the cache before this step.
        block_size: tokens per cache block.
        positions: ``[T]`` int64, position of each new token (``num_computed[r] + i``); None when the
            metadata was made without ``build``.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_computed: torch.Tensor
    block_size: int
    positions: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @classmethod
    def build(
        cls, num_computed: list[int], num_scheduled: list[int], block_ids: list[list[int]], block_size: int
    ) -> AttentionMetadata:
        """Metadata for rows that run ``num_scheduled[r]`` tokens after ``num_computed[r]`` cached ones.

        ``block_ids[r]`` must cover ``num_computed[r] + num_scheduled[r]`` tokens. ``positions`` ``[T]``
        int64 is filled too (``token_positions``' values).
        NOTE: the per-token values are computed in Python and each tensor is made by one ``torch.tensor``:
        a decode step's few tokens cost ~15 small torch ops (~5 us each) the other way, and a 2048-token
        prefill chunk's ~0.3 ms here is lost in its forward pass.

        Raises:
            ValueError: a row's block table is too short for its context, or a new token falls in a
                freed (negative id) entry.
        """
        seq_lens = [c + n for c, n in zip(num_computed, num_scheduled, strict=True)]
        for r, (length, blocks) in enumerate(zip(seq_lens, block_ids, strict=True)):
            if len(blocks) * block_size < length:
                raise ValueError(
                    f"row {r}: {len(blocks)} blocks of {block_size} tokens cannot hold {length} tokens"
                )
        width = max(1, max((len(b) for b in block_ids), default=0))
        positions = [p for c, n in zip(num_computed, num_scheduled, strict=True) for p in range(c, c + n)]
        token_blocks = [blocks[p // block_size]
                        for c, n, blocks in zip(num_computed, num_scheduled, block_ids, strict=True)
                        for p in range(c, c + n)]
        if token_blocks and min(token_blocks) < 0:
            raise ValueError("a new token's slot is in a block freed out of the sliding window")
        slots = [block * block_size + p % block_size for block, p in zip(token_blocks, positions, strict=True)]
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor([0, *itertools.accumulate(num_scheduled)], dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor([_table_row(b, width) for b in block_ids], dtype=torch.int32)
            if block_ids else torch.zeros(0, 1, dtype=torch.int32),
            num_computed=torch.tensor(num_computed, dtype=torch.int32),
            block_size=block_size,
            positions=torch.tensor(positions, dtype=torch.int64),
        )


def _table_row(blocks: list[int], width: int) -> list[int]:
    """A block table row padded with 0 to ``width`` entries, freed (negative) ids as 0."""
    row = list(blocks) if not blocks or min(blocks) >= 0 else [max(b, 0) for b in blocks]
    return row + [0] * (width - len(row))


def token_positions(num_computed: torch.Tensor, num_scheduled: torch.Tensor) -> torch.Tensor:
    """Positions ``[T]`` int64 of a flattened batch: ``num_computed[r] + 0 .. num_scheduled[r] - 1``."""
    counts = num_scheduled.long()
    starts = torch.cumsum(counts, 0) - counts
    offsets = torch.arange(int(counts.sum())) - torch.repeat_interleave(starts, counts)
    return torch.repeat_interleave(num_computed.long(), counts) + offsets


class AttentionBackend(Protocol):
    """Paged attention for one layer: store this step's K/V, attend over each row's context.

    ``kernel_max_query_len``: rows with at most this many query tokens are attended by
    ``tandem.kernels.paged_attention`` (0: none are); the fused decoder layer (``decoder_layer``)
    runs only on steps whose rows all are.
    """

    kernel_max_query_len: int

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """``q [T, H, D]``, ``k, v [T, KV, D]``; caches ``[num_blocks, block_size, KV, D]``.

        Writes k/v into the caches at ``meta.slot_mapping`` and returns ``[T, H, D]``. ``window``: a
        query at position p attends to keys ``p - window + 1 .. p`` only (a sliding-window layer; None:
        ``0 .. p``). ``softcap``: scaled scores become ``softcap * tanh(s / softcap)`` before the softmax.
        """
        ...
