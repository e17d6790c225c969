"""Paged KV cache bookkeeping: block pool, chained block hashes, the manager, leases, and sizing.

No tensors here, except ``transfer.py`` (block contents in and out of a cache), which only the
model runner imports and this package does not re-export.
"""

from tandem.kv_cache.block_pool import BlockPool, KVCacheBlock
from tandem.kv_cache.hashing import hash_block_tokens, hash_token_blocks
from tandem.kv_cache.leases import DEFAULT_LEASE_TTL_S, Lease, UnknownLeaseError
from tandem.kv_cache.manager import KVCacheManager
from tandem.kv_cache.storage import check_kv_memory, kv_cache_shape, num_blocks_for_budget, plan_num_blocks

__all__ = [
    "DEFAULT_LEASE_TTL_S",
    "BlockPool",
    "KVCacheBlock",
    "KVCacheManager",
    "Lease",
    "UnknownLeaseError",
    "check_kv_memory",
    "hash_block_tokens",
    "hash_token_blocks",
    "kv_cache_shape",
    "num_blocks_for_budget",
    "plan_num_blocks",
]
