"""The error a checkpoint that cannot be loaded raises (config, GGUF and weight readers)."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint folder Tandem cannot load: unsupported architecture or rope type, a bad config
    value, a missing or misshapen tensor, a truncated or corrupt weights file."""
