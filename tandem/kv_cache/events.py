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
and should treat that engine's index as stale (e.g. clear it and let new events rebuild it). A
sequence number that goes *down* means a new publisher (the engine restarted with an empty cache).

**Snapshot and replay** (``replay_endpoint``, a ROUTER socket; vLLM's replay request plus a snapshot):
a client (DEALER, or REQ for one answer) sends one frame, and gets messages ``[seq (8 bytes, signed
big-endian), payload]`` followed by the end marker ``[END_SEQ, b""]``:

- ``SNAPSHOT_REQUEST`` (b"snapshot"): one message ``[S, batch]``, where ``batch`` is
  ``[AllBlocksCleared, BlockStored(every cached hash)]``: the state after every batch with
  ``seq < S``. A router that joins late subscribes first, then asks for a snapshot, and applies the
  published batches with ``seq >= S`` on top of it (``fetch_snapshot``).
- an 8-byte big-endian ``start_seq`` (vLLM's form): the buffered batches with ``seq >= start_seq``
  in order (the last ``buffer_steps`` are kept), to fill a gap.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from tandem.config import KVEventsConfig


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


SNAPSHOT_REQUEST = b"snapshot"
END_SEQ = -1  # the end marker's sequence number in replay answers


def _seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


class KVEventPublisher:
    """Publishes event batches on a ZeroMQ PUB socket, and answers snapshot / replay requests.

    Frames: ``[topic, seq.to_bytes(8, "big"), encode_batch(batch)]``; ``seq`` counts batches from 0.
    PUB never blocks the engine: a slow subscriber loses messages (ZeroMQ's high-water mark) and
    sees a gap in ``seq``. The replay socket (see the module docstring) is served by ``serve_requests``,
    which the engine loop calls between steps; ``poll_socket`` is there for its poller.

    Args:
        endpoint: where to bind, e.g. ``tcp://127.0.0.1:5557``, ``tcp://127.0.0.1:*`` (a free port;
            ``endpoint`` then holds the bound one) or ``ipc:///tmp/kv-events``.
        topic: the first frame of every message (subscribers filter on it).
        replay_endpoint: where to bind the ROUTER socket for snapshots and replays (None: none).
        buffer_steps: batches kept for replay. hwm: the PUB socket's send high-water mark.

    Raises:
        zmq.ZMQError: an endpoint cannot be bound (in use, bad address).
    """

    def __init__(self, endpoint: str, topic: str = "kv-events", replay_endpoint: str | None = None,
                 buffer_steps: int = 10_000, hwm: int = 100_000) -> None:
        import zmq

        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._replay = None
        try:
            self._sock.bind(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self.close()
            raise
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic.encode()
        self.seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)

    @classmethod
    def from_config(cls, config: KVEventsConfig, rank: int = 0) -> KVEventPublisher | None:
        """The publisher of data-parallel engine ``rank`` (``KVEventsConfig.for_rank``), or None when
        events are off or not published on ZeroMQ.

        Raises:
            ValueError: an endpoint cannot be bound (the message names it and the cause).
        """
        import zmq

        if not config.publishes:
            return None
        config = config.for_rank(rank)
        try:
            return cls(config.endpoint, config.topic, config.replay_endpoint, config.buffer_steps, config.hwm)
        except zmq.ZMQError as e:
            where = " / ".join(e for e in (config.endpoint, config.replay_endpoint) if e)
            raise ValueError(f"cannot bind the KV events endpoint {where}: {e}") from None

    @property
    def poll_socket(self):
        """The replay socket to register for POLLIN in the engine loop's poller (None without one)."""
        return self._replay

    def publish(self, batch: KVEventBatch) -> None:
        """Sends one batch (never blocks) and keeps it for replay. Changes: ``seq`` (+1)."""
        import zmq

        payload = encode_batch(batch)
        frames = (self.topic, self.seq.to_bytes(8, "big"), payload)
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # no subscriber can take it; the seq gap tells them
        if self._replay is not None:
            self._buffer.append((self.seq, payload))
        self.seq += 1

    def serve_requests(self, snapshot: Callable[[], KVEventBatch]) -> int:
        """Answers every queued replay-socket request without blocking; returns how many.

        ``snapshot``: the engine's current prefix-cache map as a batch (it must include every batch
        published so far and nothing newer). A malformed request gets only the end marker.
        """
        import zmq

        if self._replay is None:
            return 0
        count = 0
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return count
            count += 1
            head = frames[:-1]  # identity, plus the empty delimiter of a REQ client
            request = frames[-1]
            if request == SNAPSHOT_REQUEST:
                replies = [(self.seq, encode_batch(snapshot()))]
            elif len(request) == 8:
                start = int.from_bytes(request, "big", signed=True)
                replies = [(seq, payload) for seq, payload in self._buffer if seq >= start]
            else:
                replies = []
            if head[-1:] == [b""]:  # NOTE: a REQ client takes one answer: everything in one message
                body = [part for seq, payload in replies for part in (_seq_bytes(seq), payload)]
                self._reply([*head, *body, _seq_bytes(END_SEQ), b""])
                continue
            for seq, payload in replies:
                self._reply([*head, _seq_bytes(seq), payload])
            self._reply([*head, _seq_bytes(END_SEQ), b""])

    def _reply(self, frames: list[bytes]) -> None:
        import zmq

        try:
            self._replay.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # NOTE: the client left or reads nothing; it asks again

    def close(self) -> None:
        self._sock.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


def fetch_replay(replay_endpoint: str, request: bytes = SNAPSHOT_REQUEST,
                 timeout_s: float = 5.0) -> list[tuple[int, KVEventBatch]]:
    """Asks a publisher's replay socket (blocking); returns ``(seq, batch)`` in order.

    ``request``: ``SNAPSHOT_REQUEST`` (one ``(S, snapshot)``: apply published batches with
    ``seq >= S`` on top) or ``start_seq.to_bytes(8, "big")`` (the buffered batches from there).

    Raises:
        TimeoutError: no complete answer within ``timeout_s``.
        msgspec.DecodeError: a malformed payload.
    """
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    out: list[tuple[int, KVEventBatch]] = []
    try:
        sock.connect(replay_endpoint)
        sock.send(request)
        deadline = time.monotonic() + timeout_s
        while True:
            if not sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                raise TimeoutError(f"no complete answer from the KV event replay socket {replay_endpoint}")
            seq_frame, payload = sock.recv_multipart()[-2:]
            seq = int.from_bytes(seq_frame, "big", signed=True)
            if seq == END_SEQ:
                return out
            out.append((seq, decode_batch(payload)))
    finally:
        sock.close(linger=0)


def fetch_snapshot(replay_endpoint: str, timeout_s: float = 5.0) -> tuple[int, KVEventBatch]:
    """``(S, batch)``: a publisher's whole prefix-cache map, valid before published batch ``S``.

    Raises:
        TimeoutError, msgspec.DecodeError: see ``fetch_replay``; ValueError: no snapshot in the answer.
    """
    answer = fetch_replay(replay_endpoint, SNAPSHOT_REQUEST, timeout_s)
    if len(answer) != 1:
        raise ValueError(f"expected one snapshot from {replay_endpoint}, got {len(answer)} messages")
    return answer[0]


def snapshot_batch(block_hashes: Iterable[int], block_size: int, engine_id: str = "") -> KVEventBatch:
    """The whole prefix-cache map as one batch: ``AllBlocksCleared`` then one ``BlockStored`` of
    ``block_hashes`` (omitted when there are none)."""
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = [AllBlocksCleared()]
    hashes = [hash_to_bytes(h) for h in block_hashes]
    if hashes:
        events.append(BlockStored(block_hashes=hashes, block_size=block_size))
    return KVEventBatch(ts=time.time(), events=events, engine_id=engine_id)


def parse_message(frames: Sequence[bytes]) -> tuple[int, KVEventBatch]:
    """``(seq, batch)`` of one received multipart message ``[topic, seq, payload]``.

    Raises:
        ValueError: not three frames or a malformed sequence number.
        msgspec.DecodeError: a malformed payload.
    """
    if len(frames) != 3 or len(frames[1]) != 8:
        raise ValueError(f"a KV event message is [topic, 8-byte seq, payload], got {len(frames)} frames")
    return int.from_bytes(frames[1], "big"), decode_batch(frames[2])
