"""BlockPool and block hashing: ref counts, LRU free queue, prefix-cache map, chained hashes."""

from __future__ import annotations

import hashlib
import struct

import pytest

from tandem.kv_cache.block_pool import BlockPool
from tandem.kv_cache.hashing import ROOT_HASH, hash_block_tokens, hash_token_blocks, update_block_hashes
from tandem.request import Request
from tandem.sampling_params import SamplingParams


def test_initial_free_order_and_allocation_from_head():
    pool = BlockPool(5)
    assert pool.free_block_ids() == [0, 1, 2, 3, 4]
    blocks = pool.get_new_blocks(2)
    assert [b.block_id for b in blocks] == [0, 1]
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert pool.num_free_blocks == 3
    assert pool.usage == pytest.approx(0.4)
    pool.check()


def test_ref_counting_shared_block():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert 0 not in pool.free_block_ids()
    pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert pool.free_block_ids() == [1, 2, 0]  # freed blocks join the tail
    pool.check()


def test_lru_eviction_order_follows_free_order():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    assert pool.num_free_blocks == 0
    pool.free_blocks([blocks[2], blocks[0]])
    pool.free_blocks([blocks[3], blocks[1]])
    assert pool.free_block_ids() == [2, 0, 3, 1]
    assert [b.block_id for b in pool.get_new_blocks(3)] == [2, 0, 3]
    assert pool.free_block_ids() == [1]


def test_not_enough_blocks_raises_and_changes_nothing():
    pool = BlockPool(2)
    pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="only 1 free"):
        pool.get_new_blocks(2)
    assert pool.free_block_ids() == [1]
    pool.check()


def test_freed_cached_block_stays_findable_until_evicted():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_full_blocks([a], [111]) == 1
    pool.free_blocks([a])
    assert pool.get_cached_block(111) is a  # free but still cached
    assert a.block_hash == 111
    pool.free_blocks([b])
    (taken,) = pool.get_new_blocks(1)  # the head of the queue is a: evicted
    assert taken is a
    assert a.block_hash is None
    assert pool.get_cached_block(111) is None
    assert pool.num_cached_blocks == 0
    pool.check()


def test_touching_cached_free_block_removes_it_from_free_queue():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks[:1], [7])
    pool.free_blocks(blocks)
    assert pool.free_block_ids() == [0, 1, 2]
    hit = pool.get_cached_block(7)
    assert hit is blocks[0]
    pool.touch([hit])  # a prefix hit by a new request
    assert hit.ref_cnt == 1
    assert pool.free_block_ids() == [1, 2]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [1, 2]  # the hit block is never handed out
    assert pool.get_cached_block(7) is hit
    pool.check()


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_full_blocks([a], [5]) == 1
    assert pool.cache_full_blocks([b], [5]) == 0
    assert pool.cache_full_blocks([a], [5]) == 0  # already cached: no-op
    assert pool.get_cached_block(5) is a
    assert b.block_hash is None
    pool.free_blocks([a, b])
    pool.get_new_blocks(1)  # evicts a, whose hash is removed
    assert pool.get_cached_block(5) is None
    pool.check()


def test_caching_disabled_never_registers():
    pool = BlockPool(2, enable_caching=False)
    a, _ = pool.get_new_blocks(2)
    assert pool.cache_full_blocks([a], [9]) == 0
    assert pool.get_cached_block(9) is None


def test_reset_prefix_cache_drops_hashes_not_refs():
    pool = BlockPool(3)
    a, b, _ = pool.get_new_blocks(3)
    pool.cache_full_blocks([a, b], [1, 2])
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() == 2
    assert pool.get_cached_block(1) is None and pool.get_cached_block(2) is None
    assert a.ref_cnt == 1 and a.block_hash is None
    assert pool.free_block_ids() == [1]
    pool.check()


def test_check_detects_corruption():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    a.ref_cnt = 0  # owned per the queue, but claims no reference
    with pytest.raises(AssertionError, match="ref_cnt 0 but in free queue = False"):
        pool.check()
    a.ref_cnt = 1
    pool.cache_full_blocks([a], [3])
    a.block_hash = 4
    with pytest.raises(AssertionError, match="hash"):
        pool.check()


# ---- hashing ----


def test_block_hash_is_sha256_of_parent_and_tokens():
    expected = hashlib.sha256(ROOT_HASH.to_bytes(32, "big") + struct.pack("<4q", 1, 2, 3, 4)).digest()
    assert hash_block_tokens(None, [1, 2, 3, 4]) == int.from_bytes(expected, "big")
    assert ROOT_HASH == int.from_bytes(hashlib.sha256(b"tandem/kv-block-root/v1").digest(), "big")


def test_block_hashes_are_chained():
    h = hash_token_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], block_size=4)
    assert len(h) == 2  # the partial block (token 9) is not hashed
    assert h[0] == hash_block_tokens(None, [1, 2, 3, 4])
    assert h[1] == hash_block_tokens(h[0], [5, 6, 7, 8])
    # same tokens, different prefix -> different hash
    other = hash_token_blocks([0, 2, 3, 4, 5, 6, 7, 8], block_size=4)
    assert other[1] != h[1]
    # same tokens split in different block sizes -> different hashes
    assert hash_token_blocks([1, 2, 3, 4], block_size=2)[-1] != h[0]


def test_update_block_hashes_covers_output_tokens_incrementally():
    req = Request("r", [1, 2, 3, 4, 5, 6], SamplingParams(), max_tokens=8)
    update_block_hashes(req, 4)
    assert req.block_hashes == hash_token_blocks([1, 2, 3, 4], 4)
    req.output_token_ids += [7, 8, 9]
    update_block_hashes(req, 4)
    assert req.block_hashes == hash_token_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
