"""Fast CPU paged attention: the C++ kernel reads the KV cache in place (online softmax, no gather).

On both kernel variants every row goes to the kernel: it tiles the queries of prompt chunks and
gives a query the same bits whatever else is in the step (batch invariance).

Per layer and step: one kernel call stores this step's K/V and attends every row with at most
``max_query_len`` query tokens (the kernel registry's limit for ``paged_attention``: any length on
``avx512_bf16`` and ``avx2``) (online softmax over the row's blocks, no gather, memory independent
of the context). A row with more query tokens runs ``F.scaled_dot_product_attention``: directly on
its new q/k/v when nothing of it is cached (``is_causal``), else on its context gathered through
the block table (as the reference does). Results match ``TorchRefAttention`` (tests/unit).

Sliding-window layers and attention soft-capping (``window``, ``softcap``) go to the kernel where the
loaded variant implements them (``kernels.supports_window_softcap``: ``avx2``); elsewhere the rows they
change (every row with a cap; with a window, the rows whose context is longer than it) run the SDPA /
explicit-score path of ``torch_ref.attend``, which applies both. A window no shorter than a row's
context is full attention and is dropped for that row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem import kernels
from tandem.attention.metadata import AttentionMetadata
from tandem.attention.torch_ref import attend_cached
from tandem.kernels import registry

_LongRow = tuple[int, int, int, int, int]  # (row, start, end, num_computed, seq_len)

class CpuPagedAttention:
    """Paged attention backend over Tandem's C++ kernel; requires ``registry.use("paged_attention")``.

    Args:
        max_query_len: rows with more query tokens than this go to SDPA (prompt chunks); None takes the
            kernel registry's limit for this machine's backend.

    ``kernel_max_query_len`` (the backend protocol's attribute) equals ``max_query_len``: rows up to that
    length run through ``kernels.paged_attention``, as the fused decoder layer needs.

    The per-step row plan (which rows are long) is computed on the first layer's call and reused by
    the other layers of that step (keyed by the identity of the step's ``AttentionMetadata`` and the
    kernel's row limit, which is 0 for a windowed or soft-capped layer the kernel cannot serve).
    """

    def __init__(self, max_query_len: int | None = None) -> None:
        if max_query_len is None:
            max_query_len = registry.max_tokens("paged_attention")
        self.max_query_len = max_query_len
        self._meta: AttentionMetadata | None = None
        self._max_seq_len = 0
        self._plans: dict[int, list[_LongRow]] = {}

    @property
    def kernel_max_query_len(self) -> int:
        """Rows with at most this many query tokens are attended by ``kernels.paged_attention``."""
        return self.max_query_len

    def _plan(self, meta: AttentionMetadata, limit: int) -> list[_LongRow]:
        """The rows with more than ``limit`` query tokens: ``(row, start, end, num_computed, seq_len)``."""
        if meta is not self._meta:
            self._meta, self._plans = meta, {}
            self._max_seq_len = int(meta.seq_lens.max()) if meta.num_reqs else 0
        if limit not in self._plans:
            starts = meta.query_start_loc.tolist()
            computed = meta.num_computed.tolist()
            seq_lens = meta.seq_lens.tolist()
            self._plans[limit] = [
                (r, starts[r], starts[r + 1], computed[r], seq_len)
                for r, seq_len in enumerate(seq_lens)
                if starts[r + 1] - starts[r] > limit
            ]
        return self._plans[limit]

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
        (tokens) and ``softcap`` as in ``AttentionBackend``.

        Changes: writes this step's k/v into the caches at ``meta.slot_mapping``.
        """
        out = torch.empty(q.shape, dtype=q.dtype)
        long_rows = self._plan(meta, self.max_query_len)  # NOTE: also sets _max_seq_len for this step
        if window is not None and window >= self._max_seq_len:
            window = None  # every key of every row is inside the window
        caches = (k_cache, v_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc)
        if (window is None and softcap is None) or kernels.supports_window_softcap():
            kernels.paged_attention(out, q, k, v, *caches, scale, self.max_query_len, window or 0, softcap or 0.0)
            rows = long_rows
        else:
            # NOTE: a kernel without the window / cap serves only the rows they cannot change (a row's
            # route depends on itself alone, so its result does not depend on the rest of the batch).
            limit = 0 if softcap is not None else self.max_query_len
            kernels.paged_attention(out, q, k, v, *caches, scale, limit)
            rows = [row for row in self._plan(meta, 0)
                    if row[2] - row[1] > limit or (window is not None and row[4] > window)]
        for r, start, end, computed, seq_len in rows:
            row_window = window if window is not None and seq_len > window else None
            if row_window is None and softcap is None and computed == 0:
                query = q[start:end].transpose(0, 1)  # [H, n, D]
                keys, values = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
                attn = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale,
                                                      enable_gqa=keys.shape[0] != query.shape[0])
                out[start:end] = attn.transpose(0, 1)
            else:
                out[start:end] = attend_cached(q[start:end], k_cache, v_cache, meta.block_tables[r], computed,
                                               seq_len, scale, row_window, softcap)
        return out


def supports(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether ``CpuPagedAttention`` can serve this model here (kernel on this backend, bf16/fp32, D <= 256)."""
    return dtype in (torch.bfloat16, torch.float32) and head_dim <= 256 and registry.use("paged_attention")
