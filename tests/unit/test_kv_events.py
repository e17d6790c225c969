"""KV cache events: the block pool reports its prefix-cache map; batches survive the wire."""

import zmq

from tandem.kv_cache.block_pool import BlockPool
from tandem.kv_cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventRecorder,
    KVEventPublisher,
    decode_batch,
    encode_batch,
    hash_from_bytes,
    hash_to_bytes,
    parse_message,
)
from tandem.kv_cache.hashing import hash_token_blocks


def _hashes(batch, kind):
    return [hash_from_bytes(h) for e in batch.events if isinstance(e, kind) for h in e.block_hashes]


def test_pool_reports_stored_evicted_and_cleared():
    rec = EventRecorder(block_size=4)
    pool = BlockPool(3, events=rec)
    hashes = hash_token_blocks(list(range(8)), 4)
    blocks = pool.get_new_blocks(2)
    assert rec.take() is None  # fresh blocks had no hash: nothing was evicted
    assert pool.cache_full_blocks(blocks, hashes) == 2
    assert pool.cache_full_blocks(blocks, hashes) == 0  # already cached: no second event
    batch = rec.take(engine_id="e0")
    assert batch.engine_id == "e0"
    assert batch.events == [BlockStored(block_hashes=[hash_to_bytes(h) for h in hashes], block_size=4)]
    pool.free_blocks(blocks)
    assert rec.take() is None  # freed but still cached: still hittable, no event
    pool.get_new_blocks(2)  # takes the never-used block, then evicts the first cached one
    assert _hashes(rec.take(), BlockRemoved) == [hashes[0]]
    assert pool.reset_prefix_cache() == 1
    assert rec.take().events == [AllBlocksCleared()]
    assert pool.cached_hashes() == []


def test_clear_supersedes_earlier_events_and_kinds_merge_in_order():
    rec = EventRecorder(block_size=16)
    rec.stored([1, 2])
    rec.stored([3])
    rec.removed([1])
    assert [type(e) for e in rec._events] == [BlockStored, BlockRemoved]
    assert _hashes(_roundtrip(rec.take()), BlockStored) == [1, 2, 3]
    rec.stored([4])
    rec.cleared()
    rec.stored([5])
    assert [type(e) for e in rec.take().events] == [AllBlocksCleared, BlockStored]


def _roundtrip(batch):
    out = decode_batch(encode_batch(batch))
    assert out == batch
    return out


def test_publisher_frames_and_sequence_numbers():
    pub = KVEventPublisher("tcp://127.0.0.1:*", topic="kv")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(pub.endpoint)
    rec = EventRecorder(block_size=16)
    try:
        # PUB drops messages until the subscription has propagated: publish until one arrives.
        got = None
        for _ in range(200):
            rec.stored([2**256 - 1])
            pub.publish(rec.take())
            if sub.poll(20):
                got = sub.recv_multipart()
                break
        assert got is not None and got[0] == b"kv"
        seq, batch = parse_message(got)
        assert 0 <= seq < pub.seq
        assert _hashes(batch, BlockStored) == [2**256 - 1]
        pub.publish(rec.take() or _one(rec))
        seq2, _ = parse_message(sub.recv_multipart())
        assert seq2 == seq + 1
    finally:
        sub.close(0)
        pub.close()


def _one(rec):
    rec.removed([7])
    return rec.take()
