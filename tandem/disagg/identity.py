"""The ``KVIdentity`` of a model runner: what a peer's KV blocks must match to be used here."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import torch

from tandem.disagg.messages import KVIdentity


def _module_digest(hasher: Any, hf_config: Any, module: torch.nn.Module) -> None:
    config = dataclasses.asdict(hf_config) if dataclasses.is_dataclass(hf_config) else vars(hf_config)
    hasher.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in module.state_dict().items():
        hasher.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())


def kv_identity(runner: Any) -> KVIdentity:
    """The identity of ``runner``'s KV caches (target, then draft model when it has one).

    ``model_hash`` is SHA-256 over each model's config (JSON, sorted keys) and its state dict's
    names, shapes and dtypes (not the weight values: hashing them would read every byte at start-up).
    Changes nothing.
    """
    hasher = hashlib.sha256()
    _module_digest(hasher, runner.hf_config, runner.model)
    caches = [(len(runner.kv_caches), runner.hf_config.num_kv_heads, runner.hf_config.head_dim)]
    draft = runner.speculator.draft if runner.speculator is not None else None
    if draft is not None:
        _module_digest(hasher, draft.hf_config, draft.model)
        caches.append((len(draft.kv_caches), draft.hf_config.num_kv_heads, draft.hf_config.head_dim))
    dtype = str(runner.dtype).removeprefix("torch.")
    return KVIdentity(hasher.hexdigest(), dtype, runner.block_size, caches)
