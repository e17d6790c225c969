"""Paged attention: per-step metadata, the backend protocol, the torch reference backend (the
oracle) and the fast CPU backend, chosen by ``select_backend``."""

import torch

from tandem.attention.cpu_paged import CpuPagedAttention, supports
from tandem.attention.metadata import AttentionBackend, AttentionMetadata, token_positions
from tandem.attention.torch_ref import TorchRefAttention

__all__ = [
    "AttentionBackend", "AttentionMetadata", "CpuPagedAttention", "TorchRefAttention", "select_backend",
    "token_positions",
]

BACKENDS = ("auto", "cpu_paged", "torch_ref")


def select_backend(head_dim: int, dtype: torch.dtype, name: str = "auto") -> AttentionBackend:
    """The attention backend for a model: "auto" picks ``CpuPagedAttention`` where the kernel registry
    has a ``paged_attention`` kernel (bf16/fp32, head_dim <= 256) and ``TorchRefAttention`` otherwise.

    Raises:
        ValueError: an unknown ``name``, or "cpu_paged" where it cannot run.
    """
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    if name == "torch_ref" or (name == "auto" and not supports(head_dim, dtype)):
        return TorchRefAttention()
    if not supports(head_dim, dtype):
        raise ValueError(f"the cpu_paged attention backend cannot run here (head_dim {head_dim}, {dtype})")
    return CpuPagedAttention()
