"""Reference paged attention: index_copy into the cache, gather each row's context, SDPA.

This is the oracle faster CPU backends are tested against; it favours clarity over speed
(one Python iteration per request, none per token).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.attention.metadata import AttentionMetadata


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``k, v [T, KV, D]`` at ``slot_mapping [T]`` of ``k_cache, v_cache [N, B, KV, D]`` (in place)."""
    num_kv, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, start: int = 0) -> torch.Tensor:
    """Tokens ``start .. seq_len - 1`` ``[seq_len - start, KV, D]`` of one row, read through its block table
    (blocks wholly before ``start`` are not read)."""
    block_size = cache.shape[1]
    first, num_blocks = start // block_size, -(-seq_len // block_size)
    blocks = cache[block_table[first:num_blocks].long()]  # [n, B, KV, D]
    offset = first * block_size
    return blocks.flatten(0, 1)[start - offset : seq_len - offset]


def attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_pos: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    key_start: int = 0,
) -> torch.Tensor:
    """Causal attention of one row: ``query [H, n, D]`` at positions ``query_pos [n]`` over ``keys, values
    [KV, S, D]`` at positions ``key_start .. key_start + S - 1`` -> ``[H, n, D]``.

    A query at position p sees keys ``p - window + 1 .. p`` (all keys up to p when ``window`` is None;
    transformers' ``sliding_window_overlay``). ``softcap`` caps the scaled scores to
    ``softcap * tanh(s / softcap)`` before the mask and softmax (Gemma 2, Gemma Team 2024); SDPA cannot,
    so the scores are then computed explicitly in (at least) float32 (transformers' ``eager_attention_forward``).
    """
    key_pos = key_start + torch.arange(keys.shape[1])
    mask = key_pos[None, :] <= query_pos[:, None]  # [n, S]
    if window is not None:
        mask &= key_pos[None, :] > query_pos[:, None] - window
    if softcap is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=keys.shape[0] != query.shape[0])
    group = query.shape[0] // keys.shape[0]
    keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    acc = torch.promote_types(query.dtype, torch.float32)  # float32, or float64 for a float64 oracle
    scores = torch.matmul(query.to(acc), keys.to(acc).transpose(1, 2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.matmul(probs.to(values.dtype), values)


def attend_cached(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_computed: int,
    seq_len: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``attend`` for one row's ``query [n, H, D]`` (positions ``num_computed ..``) over its context in the
    caches ``[N, B, KV, D]`` -> ``[n, H, D]``; with a window only from the first query's first key on."""
    start = 0 if window is None else max(0, num_computed - window + 1)
    keys = gather_context(k_cache, block_table, seq_len, start).transpose(0, 1)  # [KV, S, D]
    values = gather_context(v_cache, block_table, seq_len, start).transpose(0, 1)
    query_pos = num_computed + torch.arange(query.shape[0])
    return attend(query.transpose(0, 1), keys, values, query_pos, scale, window, softcap, start).transpose(0, 1)


class TorchRefAttention:
    """Gather + ``F.scaled_dot_product_attention`` with a causal mask offset by the cached prefix.

    Query i of a row sits at position ``num_computed + i`` and sees keys ``0 .. num_computed + i``
    (the last ``window`` of them with a sliding window; see ``attend``, which also applies soft-capping).
    Grouped-query attention (Ainslie et al. 2023) uses SDPA's ``enable_gqa``: each of the KV heads
    serves ``H / KV`` query heads.
    """

    kernel_max_query_len = 0  # no row goes through the C++ kernel

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
        """``q [T, H, D]``, ``k, v [T, KV, D]``, caches ``[N, B, KV, D]`` -> ``[T, H, D]``; ``window``
        (tokens) and ``softcap`` as in ``attend``.

        Changes: writes this step's k/v into the caches at ``meta.slot_mapping``.
        """
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        computed = meta.num_computed.tolist()
        for r, seq_len in enumerate(seq_lens):
            start, end = starts[r], starts[r + 1]
            if end == start:
                continue
            out[start:end] = attend_cached(q[start:end], k_cache, v_cache, meta.block_tables[r], computed[r],
                                           seq_len, scale, window, softcap)
        return out
