"""Paged attention: per-step metadata, the backend protocol and the torch reference backend."""

from tandem.attention.metadata import AttentionBackend, AttentionMetadata, token_positions
from tandem.attention.torch_ref import TorchRefAttention

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchRefAttention", "token_positions"]
