"""CPU execution environment of the model runner: torch intra-op threads."""

from __future__ import annotations

import os

import torch

from tandem.config import ConfigError


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity set where the OS reports one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def configure_threads(num_threads: int | None) -> int:
    """Set torch's intra-op thread count to ``num_threads``, or to every available core when None.

    Changes: the process-wide ``torch.set_num_threads`` setting. Returns the count set.

    Raises:
        ConfigError: ``num_threads`` is < 1.
    """
    if num_threads is not None and num_threads < 1:
        raise ConfigError(f"num_threads must be >= 1, got {num_threads}")
    n = num_threads if num_threads is not None else available_cores()
    torch.set_num_threads(n)
    return n
