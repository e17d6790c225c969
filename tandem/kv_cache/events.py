"""KV cache events: which prefix-cache blocks an engine holds, published over ZeroMQ for routers.

Modelled on vLLM's KV events (``vllm/distributed/kv_events.py``: ``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared`` in an ``EventBatch``, msgpack-encoded, on a ZeroMQ PUB socket as the frames
``[topic, sequence number (8 bytes, big-endian), payload]``), with two differences:

- Block hashes are Tandem's chained SHA-256 hashes (``kv_cache/hashing.py``), 256-bit ints sent as
  32-byte big-endian ``bytes`` (msgpack has no integer that wide). A router computes the same keys
  from the prompt's token ids with ``hashing.hash_token_blocks`` and the engine's block size.
- ``BlockStored`` carries no token ids and no parent hash: a chained hash already names the whole
  prefix, so the set of hashes an engine holds is all a router needs.

An event says what happened to the *prefix-cache map* (``BlockPool._cached``): stored = a block
became findable under its hash; removed = the hash left the map (its block was re-allocated, i.e.
evicted); cleared = the whole map was dropped (``reset_prefix_cache``). A block that is merely freed
(ref 0, still cached) produces no event: it can still be hit.

Sequence numbers count batches from 0 per publisher; a subscriber that sees a gap has lost events
and should treat that engine's index as stale (e.g. clear it and let new events rebuild it).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import msgspec


def hash_to_bytes(block_hash: int) -> bytes:
    """A 256-bit block hash as 32 big-endian bytes (the wire form)."""
    return block_hash.to_bytes(32, "big")


def hash_from_bytes(data: bytes) -> int:
    """Inverse of ``hash_to_bytes``.

    Raises:
        ValueError: ``data`` is not 32 bytes long.
    """
    if len(data) != 32:
        raise ValueError(f"a block hash is 32 bytes, got {len(data)}")
    return int.from_bytes(data, "big")


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    """Base of the event types (tagged by class name in the msgpack payload)."""


class BlockStored(KVCacheEvent):
    """Blocks that became findable in the prefix cache, in sequence order (hashes as 32-byte bytes)."""

    block_hashes: list[bytes]
    block_size: int


class BlockRemoved(KVCacheEvent):
    """Hashes that left the prefix cache (their blocks were evicted for reuse)."""

    block_hashes: list[bytes]


class AllBlocksCleared(KVCacheEvent):
    """The engine dropped its whole prefix cache."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """The events of one engine step.

    Attributes:
        ts: wall-clock time of publishing (seconds since the epoch).
        events: in the order they happened.
        engine_id: the publishing engine (a data-parallel rank or an instance id).
    """

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    engine_id: str = ""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """msgpack bytes of one batch."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Parses ``encode_batch``'s bytes.

    Raises:
        msgspec.DecodeError: malformed or foreign payload.
    """
    return _decoder.decode(payload)


class EventRecorder:
    """Collects a block pool's events between two ``take`` calls (one engine step).

    ``BlockPool`` calls ``stored`` / ``removed`` / ``cleared`` as its map changes; the engine core
    drains them with ``take`` after each step and hands the batch to a ``KVEventPublisher``.
    Consecutive events of the same kind are merged, keeping their order.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []

    def stored(self, block_hashes: Iterable[int]) -> None:
        hashes = [hash_to_bytes(h) for h in block_hashes]
        if not hashes:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockStored):
            last.block_hashes.extend(hashes)
        else:
            self._events.append(BlockStored(block_hashes=hashes, block_size=self.block_size))

    def removed(self, block_hashes: Iterable[int]) -> None:
        hashes = [hash_to_bytes(h) for h in block_hashes]
        if not hashes:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.extend(hashes)
        else:
            self._events.append(BlockRemoved(block_hashes=hashes))

    def cleared(self) -> None:
        # NOTE: everything recorded before a clear is moot for a subscriber; keep only the clear.
        self._events = [AllBlocksCleared()]

    def take(self, engine_id: str = "") -> KVEventBatch | None:
        """The events since the last call as one batch, or None when there were none."""
        if not self._events:
            return None
        events, self._events = self._events, []
        return KVEventBatch(ts=time.time(), events=events, engine_id=engine_id)


class KVEventPublisher:
    """Publishes event batches on a ZeroMQ PUB socket.

    Frames: ``[topic, seq.to_bytes(8, "big"), encode_batch(batch)]``; ``seq`` counts batches from 0.
    PUB never blocks the engine: a slow subscriber loses messages (ZeroMQ's high-water mark) and
    sees a gap in ``seq``.

    Args:
        endpoint: where to bind, e.g. ``tcp://127.0.0.1:5557`` or ``ipc:///tmp/kv-events``.
        topic: the first frame of every message (subscribers filter on it).

    Raises:
        zmq.ZMQError: the endpoint cannot be bound (in use, bad address).
    """

    def __init__(self, endpoint: str, topic: str = "kv-events") -> None:
        import zmq

        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic.encode()
        self.seq = 0

    def publish(self, batch: KVEventBatch) -> None:
        import zmq

        frames = (self.topic, self.seq.to_bytes(8, "big"), encode_batch(batch))
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # no subscriber can take it; the seq gap tells them
        self.seq += 1

    def close(self) -> None:
        self._sock.close(linger=0)


def parse_message(frames: Sequence[bytes]) -> tuple[int, KVEventBatch]:
    """``(seq, batch)`` of one received multipart message ``[topic, seq, payload]``.

    Raises:
        ValueError: not three frames or a malformed sequence number.
        msgspec.DecodeError: a malformed payload.
    """
    if len(frames) != 3 or len(frames[1]) != 8:
        raise ValueError(f"a KV event message is [topic, 8-byte seq, payload], got {len(frames)} frames")
    return int.from_bytes(frames[1], "big"), decode_batch(frames[2])
