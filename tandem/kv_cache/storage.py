"""KV cache sizing: how many blocks fit in a GiB budget (target + draft caches), the memory check,
and the per-layer tensor shape.

The tensors themselves are allocated by the model runner. Per layer it keeps
``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``, and token ``offset`` of block
``block_id`` lives at slot ``block_id * block_size + offset`` (PagedAttention, Kwon et al. 2023).
"""

from __future__ import annotations

import psutil

from tandem.config import CacheConfig, ConfigError

GIB = 1 << 30  # bytes
KV_MEMORY_FRACTION = 0.9  # largest share of the currently available memory the KV caches may take


def bytes_per_block(
    block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int
) -> int:
    """Bytes of one block over all layers, K and V: ``2 * layers * block_size * kv_heads * head_dim * dtype``.

    Raises:
        ConfigError: any argument is < 1.
    """
    args = {"block_size": block_size, "num_layers": num_layers, "num_kv_heads": num_kv_heads,
            "head_dim": head_dim, "dtype_bytes": dtype_bytes}
    for name, value in args.items():
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes


def num_blocks_for_budget(
    kv_cache_gib: float, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int
) -> int:
    """Number of KV blocks of one model that fit in ``kv_cache_gib`` GiB (1 GiB = 2**30 bytes), rounded down.

    Raises:
        ConfigError: the budget is not positive, or holds fewer than 2 blocks (the message gives the
            size of one block so the user knows how much to ask for).
    """
    per_block = bytes_per_block(block_size, num_layers, num_kv_heads, head_dim, dtype_bytes)
    return blocks_in_budget(kv_cache_gib, per_block, f"{block_size} tokens x {num_layers} layers")


def blocks_in_budget(kv_cache_gib: float, per_block: int, what: str = "") -> int:
    """Blocks of ``per_block`` bytes (every cache that uses a block id) in ``kv_cache_gib`` GiB.

    ``what`` describes a block in the error message. Raises ConfigError as ``num_blocks_for_budget``.
    """
    if kv_cache_gib <= 0:
        raise ConfigError(f"kv_cache_gib must be > 0, got {kv_cache_gib}")
    num_blocks = int(kv_cache_gib * GIB) // per_block
    if num_blocks < 2:
        raise ConfigError(
            f"kv_cache_gib={kv_cache_gib} holds {num_blocks} KV block(s) of {per_block} bytes "
            f"({what or 'all caches'}); at least 2 are needed, so raise kv_cache_gib "
            f"to >= {2 * per_block / GIB:.6f}"
        )
    return num_blocks


def plan_num_blocks(
    cache: CacheConfig, target_bytes_per_block: int, draft_bytes_per_block: int, max_num_seqs: int,
    max_model_len: int,
) -> int:
    """How many KV blocks the engine allocates: ``cache.num_blocks``, or what the GiB budget holds.

    A draft model's cache uses the same block ids, so a block costs ``target_bytes_per_block +
    draft_bytes_per_block`` bytes of the ``kv_cache_gib`` budget. The budget is capped at the blocks
    that can ever be used: every sequence (``max_num_seqs``) at full context (``max_model_len``
    tokens), twice over for prefix-cache reuse.

    Raises:
        ConfigError: the budget holds fewer than 2 blocks (see ``blocks_in_budget``).
    """
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_block = target_bytes_per_block + draft_bytes_per_block
    what = "target + draft caches" if draft_bytes_per_block else "the target cache"
    num_blocks = blocks_in_budget(cache.kv_cache_gib, per_block, f"{cache.block_size} tokens, {what}")
    # NOTE: small models would otherwise zero-fill gigabytes that no sequence can ever use.
    useful = 2 * max_num_seqs * -(-max_model_len // cache.block_size)
    return min(num_blocks, max(useful, 2))


def check_kv_memory(num_blocks: int, bytes_per_block_all: int, available_bytes: int | None = None) -> int:
    """Refuses a KV cache larger than ``KV_MEMORY_FRACTION`` of the memory available now; returns its bytes.

    ``bytes_per_block_all`` counts every cache indexed by the block ids (target and draft). The
    caches are zero-filled, so all of it becomes resident; 10% of what is free stays free
    (activations, logits, the front end, the OS). ``available_bytes`` defaults to psutil's
    ``virtual_memory().available``.

    Raises:
        ConfigError: ``num_blocks * bytes_per_block_all`` exceeds the limit (before anything is allocated).
    """
    needed = num_blocks * bytes_per_block_all
    available = psutil.virtual_memory().available if available_bytes is None else available_bytes
    if needed > KV_MEMORY_FRACTION * available:
        raise ConfigError(
            f"the KV cache needs {needed / GIB:.2f} GiB but only {available / GIB:.2f} GiB of "
            f"memory is available (at most {KV_MEMORY_FRACTION:.0%} of it is used); lower --kv-cache-gib "
            f"(or --num-kv-blocks)"
        )
    return needed


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    """Shape of one layer's K cache (and its V cache): ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Raises:
        ConfigError: any argument is < 1.
    """
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if min(shape) < 1:
        raise ConfigError(f"every KV cache dimension must be >= 1, got {shape}")
    return shape


def slot_of(block_ids: list[int], position: int, block_size: int) -> int:
    """Flat slot of token ``position`` of a request whose block table is ``block_ids``."""
    return block_ids[position // block_size] * block_size + position % block_size
