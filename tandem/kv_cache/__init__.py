"""Paged KV cache bookkeeping: block pool, chained block hashes, the manager, and sizing. No tensors."""

from tandem.kv_cache.block_pool import BlockPool, KVCacheBlock
from tandem.kv_cache.hashing import hash_block_tokens, hash_token_blocks
from tandem.kv_cache.manager import KVCacheManager
from tandem.kv_cache.storage import kv_cache_shape, num_blocks_for_budget

__all__ = [
    "BlockPool",
    "KVCacheBlock",
    "KVCacheManager",
    "hash_block_tokens",
    "hash_token_blocks",
    "kv_cache_shape",
    "num_blocks_for_budget",
]
