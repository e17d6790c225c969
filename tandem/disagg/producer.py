"""The prefill side's KV transfer server: a ZeroMQ ROUTER on ``kv_ip:kv_port`` serving held blocks.

It runs on the engine-core thread, between steps (``serve_pending``): the lease table and the block
generations it checks are then exactly what the scheduler sees. A pull that passes is handed to the
peer's data connection (``data_channel.KVDataServer``, its own thread) as views of the held blocks
(a run of consecutive ids is one view per layer; scattered ids are gathered on that thread), so the
engine steps on while the bytes go out, and the lease (renewed by the pull) keeps the blocks from reuse
for longer than the reply may take (its ``deadline``: half the lease).

Who may pull: a peer that sent ``KVHello`` with a matching ``KVIdentity`` and proved the shared
secret for a fresh nonce (``engine/handshake.sign``). Everything else is refused, logged and counted
(``num_refused``).
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import zmq

from tandem.disagg.data_channel import Gather, KVDataServer, SendJob
from tandem.disagg.messages import (
    KV_PROTOCOL_VERSION,
    KVAdmitted,
    KVChallenge,
    KVHello,
    KVIdentity,
    KVProof,
    KVRefused,
    PullKV,
    ReleaseLeases,
    RenewLeases,
    ToProducer,
)
from tandem.engine.handshake import NONCE_BYTES, sign
from tandem.kv_cache.leases import UnknownLeaseError
from tandem.kv_cache.transfer import as_rows

logger = logging.getLogger(__name__)

MAX_PEERS = 1024  # admitted or pending peers remembered at once; the oldest are forgotten first


class KVTransferServer:
    """Serves the KV of leased blocks to admitted decode engines.

    Args:
        ctx: the process's ZeroMQ context.
        host, port: where to bind (``KVTransferConfig.kv_ip`` / ``kv_port``).
        identity: this engine's ``KVIdentity``; a peer's must match.
        secret: the shared secret, or None (then any proof passes; loopback only, see the config).
        engine_id: this engine's id in ``KVAdmitted``.
        kv_manager: the scheduler's ``KVCacheManager`` (leases and block generations).
        kv_cache_groups: returns the runner's caches: per model (target, then draft) its per-layer
            ``(k_cache, v_cache)`` pairs.
        data_port: the data connections' port (``kv_data_port``; 0: a free one, sent in ``KVAdmitted``).
        timeout_s: seconds a data connection's send may stall before it is closed.

    Raises:
        zmq.ZMQError, OSError: an address cannot be bound (in use, or not an address of this host).
    """

    def __init__(self, ctx: zmq.Context, host: str, port: int, identity: KVIdentity, secret: bytes | None,
                 engine_id: str, kv_manager: Any, kv_cache_groups: Callable[[], list[list[Any]]],
                 data_port: int = 0, timeout_s: float = 10.0) -> None:
        self.identity = identity
        self.secret = secret
        self.engine_id = engine_id
        self.kv = kv_manager
        self.kv_cache_groups = kv_cache_groups
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # NOTE: a reply to a vanished peer raises, not drops
        self.socket.setsockopt(zmq.SNDHWM, 0)  # NOTE: a slow reader must never block the engine thread
        self.socket.bind(f"tcp://{host}:{port}")
        try:
            self.data = KVDataServer(host, data_port, timeout_s)
        except OSError:
            self.socket.close(linger=0)
            raise
        self.decoder = msgspec.msgpack.Decoder(ToProducer)
        self.encoder = msgspec.msgpack.Encoder()
        self._nonces: dict[bytes, bytes] = {}  # peer -> nonce of its pending handshake
        self._admitted: set[bytes] = set()
        self._num_refused = 0
        self.num_pulls = 0
        self.num_bytes_sent = 0
        self.num_pull_errors = 0

    @property
    def num_refused(self) -> int:
        """Peers refused: handshakes, unauthenticated messages, data connections without a valid token."""
        return self._num_refused + self.data.num_refused

    def close(self) -> None:
        self.socket.close(linger=0)
        self.data.close()

    def serve_pending(self) -> int:
        """Handles every queued message without blocking; returns how many.

        Changes: renews or releases leases, sends the KV of pulled blocks, the peer tables and counters.
        """
        handled = 0
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return handled
            handled += 1
            if len(frames) < 2:
                continue
            peer, payload = frames[0], frames[1]
            try:
                message = self.decoder.decode(payload)
            except msgspec.DecodeError:
                self._refuse(peer, "unreadable message (not the Tandem KV protocol)")
                continue
            try:
                self._handle(peer, message)
            except zmq.ZMQError as e:
                logger.warning("KV transfer: could not answer a peer: %s", e)

    def _handle(self, peer: bytes, message: Any) -> None:
        if isinstance(message, KVHello):
            self._on_hello(peer, message)
        elif isinstance(message, KVProof):
            self._on_proof(peer, message)
        elif peer not in self._admitted:
            self._refuse(peer, "not authenticated: send KVHello and a KVProof first")
        elif isinstance(message, PullKV):
            self._on_pull(peer, message)
        elif isinstance(message, RenewLeases):
            for lease_id in message.lease_ids:
                try:
                    self.kv.renew(lease_id)
                except UnknownLeaseError:
                    pass  # NOTE: expired; the pull that follows reports it
        elif isinstance(message, ReleaseLeases):
            for lease_id in message.lease_ids:
                if lease_id in self.kv.leases:
                    self.kv.release(lease_id)

    def _send(self, peer: bytes, message: Any, *frames: Any) -> None:
        self.socket.send_multipart([peer, self.encoder.encode(message), *frames], copy=False)

    def _refuse(self, peer: bytes, reason: str) -> None:
        self._num_refused += 1
        self._nonces.pop(peer, None)
        self._admitted.discard(peer)
        logger.warning("KV transfer: refused a peer: %s (%d refused so far)", reason, self.num_refused)
        self._send(peer, KVRefused(reason))

    def _on_hello(self, peer: bytes, hello: KVHello) -> None:
        if hello.protocol != KV_PROTOCOL_VERSION:
            self._refuse(peer, f"KV protocol {hello.protocol} is not supported (this engine speaks "
                               f"{KV_PROTOCOL_VERSION})")
            return
        mismatches = self.identity.mismatches(hello.identity)
        if mismatches:
            self._refuse(peer, "incompatible KV caches (this prefill engine vs the decode engine): "
                               + "; ".join(mismatches))
            return
        if len(self._nonces) >= MAX_PEERS:
            self._nonces.pop(next(iter(self._nonces)))
        nonce = os.urandom(NONCE_BYTES)
        self._nonces[peer] = nonce
        self._send(peer, KVChallenge(nonce, self.secret is not None))

    def _on_proof(self, peer: bytes, proof: KVProof) -> None:
        nonce = self._nonces.pop(peer, None)
        if nonce is None:
            self._refuse(peer, "no handshake in progress: send KVHello first")
            return
        if self.secret is not None and not hmac.compare_digest(proof.mac, sign(self.secret, nonce)):
            self._refuse(peer, "wrong or missing KV transfer secret")
            return
        if len(self._admitted) >= MAX_PEERS:
            self._admitted.pop()
        self._admitted.add(peer)
        self._send(peer, KVAdmitted(self.engine_id, self.data.port, self.data.issue_token(peer)))

    def _check_pull(self, pull: PullKV) -> str | None:
        """Why ``pull`` cannot be served, or None. Renews its lease when it can."""
        if not pull.block_ids:
            return "a pull must name at least one block"
        try:
            held = set(self.kv.held_block_ids(pull.lease_id))
        except UnknownLeaseError:
            return f"lease {pull.lease_id!r} is unknown or expired: its blocks may have been reused"
        if len(pull.generations) != len(pull.block_ids) or not set(pull.block_ids) <= held:
            return f"blocks {pull.block_ids} are not all held under lease {pull.lease_id!r}"
        now = self.kv.block_generations(pull.block_ids)
        if now != list(pull.generations):
            return (f"blocks {pull.block_ids} were freed and reused since the prefill (generations "
                    f"{list(pull.generations)} -> {now})")
        self.kv.renew(pull.lease_id)
        return None

    def _on_pull(self, peer: bytes, pull: PullKV) -> None:
        reason = self._check_pull(pull)
        if reason is not None:
            self.num_pull_errors += 1
            logger.warning("KV transfer: refused a pull: %s", reason)
            self._reply(peer, SendJob(pull.xfer_id, [], 0.0, reason))
            return
        frames = self._frames(pull.block_ids)
        # NOTE: held blocks are never written, and the pull renewed their lease: until half of it has passed
        # the blocks cannot have been reused (the channel checks this before it ends the reply)
        if self._reply(peer, SendJob(pull.xfer_id, frames, time.monotonic() + self.kv.leases.ttl_s / 2)):
            self.num_pulls += 1
            self.num_bytes_sent += sum(f.nbytes if isinstance(f, memoryview) else f.index.size * f.rows.shape[1]
                                       for f in frames)

    def _frames(self, block_ids: list[int]) -> list[memoryview | Gather]:
        """Per cache, layer, K then V: a view of the blocks (consecutive ids) or what to gather (others)."""
        first, n = block_ids[0], len(block_ids)
        run = block_ids == list(range(first, first + n))
        index = None if run else np.asarray(block_ids, dtype=np.int64)
        rows = [as_rows(cache) if cache.is_contiguous() else as_rows(cache.contiguous())
                for layers in self.kv_cache_groups() for pair in layers for cache in pair]
        return [memoryview(r[first:first + n]).cast("B") if run else Gather(r, index) for r in rows]

    def _reply(self, peer: bytes, job: SendJob) -> bool:
        """Queues a pull's reply on the peer's data connection; a peer without one must handshake again."""
        if self.data.send(peer, job):
            return True
        self._refuse(peer, "no KV data connection (closed or never opened): handshake again")
        return False
