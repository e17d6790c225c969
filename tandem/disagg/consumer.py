"""The decode side's KV puller: background threads that fetch remote blocks into the local cache.

The engine thread queues work (``submit``, ``renew``, ``release``) for the thread of the prefill engine it
names: each producer address gets a thread of its own (up to ``MAX_PULL_THREADS``; later ones share the
last), so a producer that is slow or silent (a handshake waits up to ``timeout_s``) holds up only the
pulls from it, never those from other producers; one producer's work stays in order. A thread owns its
producers' sockets (per prefill engine one DEALER, with the ``messages`` handshake done once per
connection, and its data connection, ``data_channel.py``), sends the pull and receives each layer's
bytes straight into the request's local blocks (``recv_into`` views of the blocks the scheduler
allocated for it, one per run of consecutive ids; scattered ids go through the thread's reused buffer
and one numpy copy; no step reads the blocks while the request waits for remote KV). Finished pulls are
reported through ``results()``, and a byte on the ``wake`` socket wakes an idle engine loop. A producer
that closes the data connection (killed: its kernel closes it) fails the pull at once, one that stays
silent for ``timeout_s`` fails it then; either way both connections are dropped, so late bytes can
never land in reused blocks.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch
import zmq

from tandem.disagg.data_channel import DATA, DONE, FAIL, HEADER, set_timeouts
from tandem.disagg.messages import (
    KVAdmitted,
    KVChallenge,
    KVHello,
    KVIdentity,
    KVProof,
    KVRefused,
    PullKV,
    ReleaseLeases,
    RenewLeases,
    ToConsumer,
)
from tandem.engine.handshake import sign
from tandem.kv_cache.transfer import as_rows, write_rows

logger = logging.getLogger(__name__)

MAX_DIRECT_RUNS = 8  # a layer's destination in at most this many runs of blocks is received in place
MAX_PULL_THREADS = 16  # producer addresses with a pull thread of their own; later ones share the last


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
    """Pulls remote KV blocks, on one thread per producer address (see the module docstring).

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
        self._queues: dict[tuple[str, int], queue.Queue] = {}  # producer address -> its thread's commands
        self._threads: list[tuple[threading.Thread, queue.Queue]] = []
        self._results: queue.Queue[PullResult] = queue.Queue()
        self._peers: dict[tuple[str, int], zmq.Socket] = {}
        self._data: dict[tuple[str, int], socket.socket] = {}  # each peer's data connection
        self._local = threading.local()  # per thread: the staging buffer, the msgpack encoder and decoder
        self._unreachable: dict[tuple[str, int], tuple[str, float]] = {}  # a renew's failed handshake: why, when
        self._xfer_ids = iter(range(1, 1 << 62))
        address = f"inproc://tandem-kv-wake-{id(self)}"
        self.wake = ctx.socket(zmq.PAIR)  # NOTE: the engine loop polls this end
        self.wake.bind(address)
        self._wake_sender = ctx.socket(zmq.PAIR)
        self._wake_sender.connect(address)
        self._wake_lock = threading.Lock()  # NOTE: the pull threads share the wake socket

    # ---- engine thread ----
    def submit(self, job: PullJob) -> None:
        self._queue((job.host, job.port)).put(("pull", job))

    def renew(self, host: str, port: int, lease_ids: list[str]) -> None:
        self._queue((host, port)).put(("send", (host, port), RenewLeases(lease_ids)))

    def release(self, host: str, port: int, lease_ids: list[str]) -> None:
        self._queue((host, port)).put(("send", (host, port), ReleaseLeases(lease_ids)))

    def _queue(self, address: tuple[str, int]) -> queue.Queue:
        """The command queue of ``address``'s pull thread, started at its first use."""
        commands = self._queues.get(address)
        if commands is None:
            if len(self._threads) < MAX_PULL_THREADS:
                commands = queue.Queue()
                thread = threading.Thread(target=self._run, args=(commands,), daemon=True,
                                          name=f"tandem-kv-puller-{len(self._threads)}")
                self._threads.append((thread, commands))
                thread.start()
            else:
                commands = self._threads[-1][1]
            self._queues[address] = commands
        return commands

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
        for _, commands in self._threads:
            commands.put(("stop",))
        deadline = time.monotonic() + 5  # NOTE: one bound for all: threads inside a handshake stop after it
        for thread, _ in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._wake_lock:
            self._wake_sender.close(linger=0)
        self.wake.close(linger=0)

    # ---- the pull threads ----
    def _run(self, commands: queue.Queue) -> None:
        self._local.staging = np.empty(0, dtype=np.uint8)  # reused for blocks that are not one run
        self._local.encoder = msgspec.msgpack.Encoder()
        self._local.decoder = msgspec.msgpack.Decoder(ToConsumer)
        while True:
            command = commands.get()
            if command[0] == "stop":
                break
            if command[0] == "send":
                self._send_quietly(command[1], command[2])
                continue
            self._results.put(self._pull(command[1]))
            with self._wake_lock:
                try:
                    self._wake_sender.send(b"", zmq.NOBLOCK)
                except zmq.ZMQError:  # NOTE: closed: close() gave up waiting for this thread
                    break
        for address in [a for a, q in list(self._queues.items()) if q is commands]:
            self._drop(address)

    @property
    def _encoder(self) -> msgspec.msgpack.Encoder:
        return self._local.encoder

    @property
    def _decoder(self) -> msgspec.msgpack.Decoder:
        return self._local.decoder

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

    def _silent(self, what: str) -> TransferError:
        return TransferError(f"the prefill engine sent nothing for {self.timeout_ms / 1000:g} s ({what})")

    def _recv(self, sock: zmq.Socket, what: str) -> Any:
        if not sock.poll(self.timeout_ms):
            raise self._silent(what)
        try:
            return self._decoder.decode(sock.recv())
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
            reply = self._recv(sock, "handshake")
            if isinstance(reply, KVChallenge):
                mac = sign(self.secret, reply.nonce) if self.secret is not None else b""
                sock.send(self._encoder.encode(KVProof(mac)))
                reply = self._recv(sock, "handshake")
            if isinstance(reply, KVRefused):
                raise TransferError(f"the prefill engine at {address[0]}:{address[1]} refused this decode "
                                    f"engine: {reply.reason}")
            if not isinstance(reply, KVAdmitted):
                raise TransferError(f"unexpected handshake reply {type(reply).__name__}")
            self._data[address] = self._connect_data(address[0], reply)
        except BaseException:
            sock.close(linger=0)
            raise
        self._peers[address] = sock
        return sock

    def _connect_data(self, host: str, admitted: KVAdmitted) -> socket.socket:
        """The data connection the producer announced, after sending its token."""
        try:
            data = socket.create_connection((host, admitted.data_port), timeout=self.timeout_ms / 1000)
            data.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_timeouts(data, self.timeout_ms / 1000)
            data.sendall(admitted.data_token)
        except OSError as e:
            raise TransferError(f"cannot open the KV data connection to {host}:{admitted.data_port}: {e}") from None
        return data

    def _drop(self, address: tuple[str, int]) -> None:
        sock = self._peers.pop(address, None)
        if sock is not None:
            sock.close(linger=0)
        data = self._data.pop(address, None)
        if data is not None:
            data.close()

    def _fetch(self, sock: zmq.Socket, job: PullJob) -> int:
        """Sends the pull and receives every layer into the job's blocks; returns the bytes received."""
        data = self._data[(job.host, job.port)]
        xfer_id = next(self._xfer_ids)
        sock.send(self._encoder.encode(PullKV(xfer_id, job.lease_id, job.remote_block_ids, job.generations)))
        self._await_reply(sock, data)
        magic, got_id, size = HEADER.unpack(_recv_bytes(data, HEADER.size, "KV blocks", self._silent))
        if got_id != xfer_id:
            raise TransferError(f"the data connection is out of step (reply to pull {got_id}, expected {xfer_id})")
        if magic == FAIL:
            reason = _recv_bytes(data, size, "KV blocks", self._silent).decode(errors="replace")
            raise TransferError(f"the prefill engine refused the pull: {reason}")
        caches = self.kv_cache_groups()
        expected = len(job.local_block_ids) * sum(c[0].nbytes for layers in caches for pair in layers for c in pair)
        if magic != DATA or size != expected:
            raise TransferError(f"unexpected reply {magic!r} of {size} bytes to a pull of {expected} bytes")
        index = np.asarray(job.local_block_ids, dtype=np.int64)
        runs = _runs(job.local_block_ids)
        received = 0
        for layers in caches:
            for pair in layers:
                for cache in pair:
                    received += self._recv_frame(data, cache, index, runs)
        end = _recv_bytes(data, HEADER.size, "KV blocks", self._silent)
        if end != HEADER.pack(DONE, xfer_id, size):
            raise TransferError(f"the pull ended without its trailer ({end[:4]!r} after {received} bytes)")
        return received

    def _await_reply(self, sock: zmq.Socket, data: socket.socket) -> None:
        """Waits until the data connection has bytes (or is closed); a refusal on ``sock`` raises."""
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(data, zmq.POLLIN)
        deadline = time.monotonic() + self.timeout_ms / 1000
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(left * 1000))
            if data.fileno() in ready:
                return
            if sock in ready:
                reply = self._recv(sock, "KV blocks")
                if isinstance(reply, KVRefused):
                    raise TransferError(f"the prefill engine refused this decode engine: {reply.reason}")
        raise self._silent("KV blocks")

    def _recv_frame(self, data: socket.socket, cache: torch.Tensor, index: np.ndarray,
                    runs: list[tuple[int, int]]) -> int:
        """Receives one layer's K (or V) of the pulled blocks into ``cache``; returns its bytes."""
        row = cache.nbytes // cache.shape[0]
        if cache.is_contiguous() and len(runs) <= MAX_DIRECT_RUNS:
            rows = as_rows(cache)
            for start, length in runs:
                _recv_into(data, memoryview(rows[start:start + length]).cast("B"), "KV blocks", self._silent)
            return row * len(index)
        n = row * len(index)
        if self._local.staging.nbytes < n:
            self._local.staging = np.empty(n, dtype=np.uint8)
        staging = self._local.staging
        _recv_into(data, memoryview(staging[:n]), "KV blocks", self._silent)
        rows = torch.from_numpy(staging[:n]).view(cache.dtype).view(len(index), *cache.shape[1:])
        write_rows(cache, index, rows)
        return n


def _runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """``block_ids`` as ``(first id, length)`` runs of consecutive ids, in order."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def _recv_into(sock: socket.socket, view: memoryview, what: str, silent: Callable[[str], Exception]) -> None:
    """Fills ``view`` from ``sock``. Raises TransferError: the peer closed the connection or went silent."""
    got, n = 0, view.nbytes
    while got < n:
        try:  # NOTE: MSG_WAITALL: the kernel fills the view in one call, without the GIL (fewer on a timeout)
            k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        except (TimeoutError, BlockingIOError):  # NOTE: SO_RCVTIMEO passed with no byte
            raise silent(what) from None
        except OSError as e:
            raise TransferError(f"the KV data connection failed after {got} of {n} bytes: {e}") from None
        if k == 0:
            raise TransferError(f"the prefill engine closed the KV data connection after {got} of {n} bytes "
                                f"({what}; it died or dropped this decode engine)")
        got += k


def _recv_bytes(sock: socket.socket, n: int, what: str, silent: Callable[[str], Exception]) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf), what, silent)
    return bytes(buf)
