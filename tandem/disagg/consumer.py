"""The decode side's KV puller: one background thread that fetches remote blocks into the local cache.

The engine thread queues work (``submit``, ``renew``, ``release``); the thread owns every socket (one
DEALER per prefill engine, with the ``messages`` handshake done once per connection), pulls layer by
layer and writes each layer into the request's local blocks as it arrives (``index_copy_`` on the
blocks the scheduler allocated for it; no step reads them while the request waits for remote KV).
Finished pulls are reported through ``results()``, and a byte on the ``wake`` socket wakes an idle
engine loop. A producer that stays silent for ``timeout_s`` (dead, unreachable, killed mid-transfer)
fails the pull and its connection is dropped, so late frames can never land in reused blocks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch
import zmq

from tandem.disagg.messages import (
    KVAdmitted,
    KVChallenge,
    KVHello,
    KVIdentity,
    KVProof,
    KVRefused,
    LayerHeader,
    PullDone,
    PullError,
    PullKV,
    ReleaseLeases,
    RenewLeases,
    ToConsumer,
)
from tandem.engine.handshake import sign
from tandem.kv_cache.transfer import write_rows

logger = logging.getLogger(__name__)


class TransferError(Exception):
    """A pull that did not deliver every layer (refused, stale blocks, timeout, bad reply)."""


@dataclass
class PullJob:
    """Fetch ``remote_block_ids`` (at ``generations``) of ``lease_id`` from ``host:port`` into
    ``local_block_ids`` (same length, same order)."""

    request_id: str
    host: str
    port: int
    lease_id: str
    remote_block_ids: list[int]
    generations: list[int]
    local_block_ids: list[int]


@dataclass
class PullResult:
    request_id: str
    error: str | None  # None: every layer of every cache arrived
    num_bytes: int
    seconds: float


class KVPuller:
    """Pulls remote KV blocks on one thread.

    Args:
        ctx: the process's ZeroMQ context (the ``wake`` socket is ``inproc`` on it).
        identity: this engine's ``KVIdentity`` (sent in the handshake).
        secret: the shared secret, or None.
        kv_cache_groups: the local caches, per model (target, then draft) its ``(k, v)`` per layer.
        timeout_s: seconds to wait for each reply of a producer.
    """

    def __init__(self, ctx: zmq.Context, identity: KVIdentity, secret: bytes | None,
                 kv_cache_groups: Callable[[], list[list[Any]]], timeout_s: float) -> None:
        self.ctx = ctx
        self.identity = identity
        self.secret = secret
        self.kv_cache_groups = kv_cache_groups
        self.timeout_ms = int(timeout_s * 1000)
        self._commands: queue.Queue = queue.Queue()
        self._results: queue.Queue[PullResult] = queue.Queue()
        self._peers: dict[tuple[str, int], zmq.Socket] = {}
        self._unreachable: dict[tuple[str, int], tuple[str, float]] = {}  # a renew's failed handshake: why, when
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ToConsumer)
        self._xfer_ids = iter(range(1, 1 << 62))
        address = f"inproc://tandem-kv-wake-{id(self)}"
        self.wake = ctx.socket(zmq.PAIR)  # NOTE: the engine loop polls this end
        self.wake.bind(address)
        self._wake_sender = ctx.socket(zmq.PAIR)
        self._wake_sender.connect(address)
        self._thread = threading.Thread(target=self._run, name="tandem-kv-puller", daemon=True)
        self._thread.start()

    # ---- engine thread ----
    def submit(self, job: PullJob) -> None:
        self._commands.put(("pull", job))

    def renew(self, host: str, port: int, lease_ids: list[str]) -> None:
        self._commands.put(("send", (host, port), RenewLeases(lease_ids)))

    def release(self, host: str, port: int, lease_ids: list[str]) -> None:
        self._commands.put(("send", (host, port), ReleaseLeases(lease_ids)))

    def results(self) -> list[PullResult]:
        """Pulls finished since the last call (drains the wake socket too). Changes: the result queue."""
        while True:
            try:
                self.wake.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._commands.put(("stop",))
        self._thread.join(timeout=5)
        self.wake.close(linger=0)

    # ---- the thread ----
    def _run(self) -> None:
        while True:
            command = self._commands.get()
            if command[0] == "stop":
                break
            if command[0] == "send":
                self._send_quietly(command[1], command[2])
                continue
            self._results.put(self._pull(command[1]))
            self._wake_sender.send(b"", zmq.NOBLOCK)
        for sock in self._peers.values():
            sock.close(linger=0)
        self._wake_sender.close(linger=0)

    def _send_quietly(self, address: tuple[str, int], message: Any) -> None:
        if isinstance(message, ReleaseLeases) and address not in self._peers:
            return  # NOTE: no connection (the producer is gone or never answered): its leases expire
        if self._recent_failure(address, keep=True) is not None:
            return  # NOTE: the next pull reports it; handshaking again would be refused (and counted) again
        try:
            self._peer(address).send(self._encoder.encode(message), zmq.NOBLOCK)
        except TransferError as e:
            self._unreachable[address] = (str(e), time.monotonic())
            logger.warning("KV transfer: could not reach %s:%d to send %s: %s", *address,
                           type(message).__name__, e)
        except zmq.ZMQError as e:
            logger.warning("KV transfer: could not reach %s:%d to send %s: %s", *address,
                           type(message).__name__, e)

    def _pull(self, job: PullJob) -> PullResult:
        t0 = time.monotonic()
        address = (job.host, job.port)
        reason = self._recent_failure(address, keep=False)
        if reason is not None:  # NOTE: one handshake per failure, so a refusal is counted once
            return PullResult(job.request_id, reason, 0, 0.0)
        try:
            num_bytes = self._fetch(self._peer(address), job)
        except (TransferError, zmq.ZMQError) as e:
            self._drop(address)
            return PullResult(job.request_id, f"{e}", 0, time.monotonic() - t0)
        return PullResult(job.request_id, None, num_bytes, time.monotonic() - t0)

    def _recent_failure(self, address: tuple[str, int], keep: bool) -> str | None:
        """Why a renew's handshake with ``address`` failed within the last ``timeout_s``, or None."""
        failure = self._unreachable.get(address) if keep else self._unreachable.pop(address, None)
        if failure is None or time.monotonic() - failure[1] > self.timeout_ms / 1000:
            self._unreachable.pop(address, None)
            return None
        return failure[0]

    def _recv(self, sock: zmq.Socket, what: str) -> tuple[Any, list[zmq.Frame]]:
        if not sock.poll(self.timeout_ms):
            raise TransferError(f"the prefill engine sent nothing for {self.timeout_ms / 1000:g} s ({what})")
        frames = sock.recv_multipart(copy=False)
        try:
            return self._decoder.decode(frames[0].buffer), frames[1:]
        except msgspec.DecodeError as e:
            raise TransferError(f"unreadable reply from the prefill engine: {e}") from None

    def _peer(self, address: tuple[str, int]) -> zmq.Socket:
        """The admitted connection to ``address``, connecting and handshaking first if needed."""
        sock = self._peers.get(address)
        if sock is not None:
            return sock
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        host = f"[{address[0]}]" if ":" in address[0] else address[0]
        sock.connect(f"tcp://{host}:{address[1]}")
        try:
            sock.send(self._encoder.encode(KVHello(self.identity)))
            reply, _ = self._recv(sock, "handshake")
            if isinstance(reply, KVChallenge):
                mac = sign(self.secret, reply.nonce) if self.secret is not None else b""
                sock.send(self._encoder.encode(KVProof(mac)))
                reply, _ = self._recv(sock, "handshake")
            if isinstance(reply, KVRefused):
                raise TransferError(f"the prefill engine at {address[0]}:{address[1]} refused this decode "
                                    f"engine: {reply.reason}")
            if not isinstance(reply, KVAdmitted):
                raise TransferError(f"unexpected handshake reply {type(reply).__name__}")
        except BaseException:
            sock.close(linger=0)
            raise
        self._peers[address] = sock
        return sock

    def _drop(self, address: tuple[str, int]) -> None:
        sock = self._peers.pop(address, None)
        if sock is not None:
            sock.close(linger=0)

    def _fetch(self, sock: zmq.Socket, job: PullJob) -> int:
        """Sends the pull and writes each arriving layer; returns the bytes received."""
        xfer_id = next(self._xfer_ids)
        sock.send(self._encoder.encode(PullKV(xfer_id, job.lease_id, job.remote_block_ids, job.generations)))
        caches = self.kv_cache_groups()
        expected = {(c, layer) for c, layers in enumerate(caches) for layer in range(len(layers))}
        index = np.asarray(job.local_block_ids, dtype=np.int64)
        num_bytes = 0
        while True:
            reply, frames = self._recv(sock, "KV blocks")
            if getattr(reply, "xfer_id", xfer_id) != xfer_id:
                continue  # NOTE: a late reply to an earlier pull on this connection
            if isinstance(reply, PullError):
                raise TransferError(f"the prefill engine refused the pull: {reply.reason}")
            if isinstance(reply, PullDone):
                if expected:
                    raise TransferError(f"the transfer ended with {len(expected)} layers missing")
                return num_bytes
            if not isinstance(reply, LayerHeader) or len(frames) != 2 or (reply.cache, reply.layer) not in expected:
                raise TransferError(f"unexpected message {type(reply).__name__} during a pull")
            k, v = caches[reply.cache][reply.layer]
            shape = (len(job.local_block_ids), *k.shape[1:])
            if tuple(reply.shape) != shape:
                raise TransferError(f"layer {reply.layer}: blocks of shape {reply.shape}, expected {list(shape)}")
            for cache, frame in ((k, frames[0]), (v, frames[1])):
                write_rows(cache, index, _as_tensor(frame, cache.dtype, shape))
                num_bytes += len(frame.buffer)
            expected.discard((reply.cache, reply.layer))


def _as_tensor(frame: zmq.Frame, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A view of a received frame as a ``shape`` tensor of ``dtype`` (no copy).

    Raises: TransferError: the frame's size does not match.
    """
    size = torch.empty((), dtype=dtype).element_size()
    if len(frame.buffer) != size * int(torch.Size(shape).numel()):
        raise TransferError(f"a KV frame of {len(frame.buffer)} bytes does not hold {list(shape)} {dtype}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NOTE: the frame is read-only; the tensor is only read
        raw = torch.frombuffer(frame.buffer, dtype=torch.uint8)
    return raw.view(dtype).view(shape)
