"""KV cache sizing: how many blocks fit in a GiB budget, and the per-layer tensor shape.

The tensors themselves are allocated by the model runner. Per layer it keeps
``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``, and token ``offset`` of block
``block_id`` lives at slot ``block_id * block_size + offset`` (PagedAttention, Kwon et al. 2023).
"""

from __future__ import annotations

from tandem.config import ConfigError

GIB = 1 << 30  # bytes


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
    """Number of KV blocks that fit in ``kv_cache_gib`` GiB (1 GiB = 2**30 bytes), rounded down.

    Raises:
        ConfigError: the budget is not positive, or holds fewer than 2 blocks (the message gives the
            size of one block so the user knows how much to ask for).
    """
    if kv_cache_gib <= 0:
        raise ConfigError(f"kv_cache_gib must be > 0, got {kv_cache_gib}")
    per_block = bytes_per_block(block_size, num_layers, num_kv_heads, head_dim, dtype_bytes)
    num_blocks = int(kv_cache_gib * GIB) // per_block
    if num_blocks < 2:
        raise ConfigError(
            f"kv_cache_gib={kv_cache_gib} holds {num_blocks} KV block(s) of {per_block} bytes "
            f"({block_size} tokens x {num_layers} layers); at least 2 are needed, so raise kv_cache_gib "
            f"to >= {2 * per_block / GIB:.6f}"
        )
    return num_blocks


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
