"""The KV transfer's data channel: one plain TCP connection per admitted decode engine for the block bytes.

The control messages (handshake, ``PullKV``, leases) travel over ZeroMQ (``messages.py``); the bytes of
a pull travel here, so that both ends move them with the kernel's copy only: the producer sends from
views of its held blocks (``socket.sendall`` on a memoryview, no intermediate bytes), the consumer
receives straight into the blocks it allocated (``socket.recv_into`` a view of the cache). ZeroMQ
cannot receive into caller memory: its frames land in fresh buffers and need one more copy, which held a
pull at 0.48x of a raw socket.

Admission: the producer hands each admitted peer a random token in ``KVAdmitted`` (over the
authenticated ZeroMQ channel); the peer's first bytes on a new data connection must be that token,
else the connection is closed and counted (``num_refused``). A token serves one connection.

One reply per ``PullKV``, in order: ``HEADER`` (magic ``DATA``, xfer id, byte count) then the bytes, per
cache (target, then draft) and layer K then V, each the ``[n_blocks, block_size, kv_heads, head_dim]``
slice of the pulled blocks in the cache dtype, then ``HEADER`` (magic ``DONE``, the same id and count);
or ``HEADER`` (magic ``FAIL``, xfer id, length) and that many bytes of UTF-8 reason. A producer that
cannot finish a reply while the lease surely holds the blocks (``deadline``) closes the connection
instead of ending it, so a decode side never takes bytes of reused blocks as complete.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

HEADER = struct.Struct("<4sQQ")  # magic, xfer id, byte count
DATA, DONE, FAIL = b"DATA", b"DONE", b"FAIL"
TOKEN_BYTES = 32
MAX_CHANNELS = 1024  # tokens issued and connections open at once; the oldest are closed first


@dataclass
class Gather:
    """Bytes to send that are not one run in memory: ``rows[index]`` (``rows`` ``[blocks, bytes per block]``)."""

    rows: np.ndarray
    index: np.ndarray


@dataclass
class SendJob:
    """One pull's reply: ``frames`` (memoryviews, or ``Gather`` copied into a reused buffer on the channel's
    thread) or an error ``reason``; ``deadline`` (monotonic seconds): the last moment bytes may be read."""

    xfer_id: int
    frames: list[memoryview | Gather]
    deadline: float
    reason: str | None = None


def set_timeouts(sock: socket.socket, seconds: float) -> None:
    """Blocking ``sock`` whose sends and receives fail (``BlockingIOError``) after ``seconds`` of no progress.

    NOTE: the kernel's ``SO_RCVTIMEO`` / ``SO_SNDTIMEO``, not ``settimeout``: Python's timeout polls before
    every ``recv_into`` / ``send``, one more system call per chunk (a layer-by-layer pull ran at 0.84x of a
    blocking socket with it)."""
    sock.settimeout(None)
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def send_frame(sock: socket.socket, frame: memoryview | Gather, staging: list[np.ndarray]) -> int:
    """Sends one frame; returns its bytes. ``staging[0]``: the reused gather buffer (grown as needed)."""
    if isinstance(frame, memoryview):
        sock.sendall(frame)
        return frame.nbytes
    n = len(frame.index) * frame.rows.shape[1]
    if staging[0].nbytes < n:
        staging[0] = np.empty(n, dtype=np.uint8)
    out = staging[0][:n].reshape(len(frame.index), frame.rows.shape[1])
    np.take(frame.rows, frame.index, axis=0, out=out)  # NOTE: one thread, GIL released; the cache stays hot
    sock.sendall(memoryview(out).cast("B"))
    return n


class _Channel:
    """One admitted peer's data connection and its queue of replies."""

    def __init__(self) -> None:
        self.jobs: queue.Queue[SendJob | None] = queue.Queue()
        self.sock: socket.socket | None = None
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self.jobs.put(None)
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class KVDataServer:
    """The producer's data listener: accepts decode engines' data connections and sends pull replies.

    Each connection has its own thread, so a slow or dead decode engine holds up only its own replies
    (and at most ``timeout_s`` per send). The engine thread only queues (``send``).

    Args:
        host, port: where to listen (``kv_ip``, ``kv_data_port``; 0 picks a free port, see ``port``).
        timeout_s: seconds a send (or a new connection's token) may stall before the connection is closed.

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.create_server((host, port), family=family, backlog=64)
        self.port = self.listener.getsockname()[1]
        self._lock = threading.Lock()
        self._tokens: dict[bytes, _Channel] = {}  # issued, not yet connected
        self._channels: dict[bytes, _Channel] = {}  # ZeroMQ peer id -> its channel
        self.num_refused = 0
        self._send_frame: Callable[[socket.socket, memoryview | Gather, list[np.ndarray]], int] = send_frame
        threading.Thread(target=self._accept, name="tandem-kv-data-accept", daemon=True).start()

    def issue_token(self, peer: bytes) -> bytes:
        """A fresh token for ``peer``'s data connection (its earlier channel, if any, is closed).

        Changes: the channel tables (the oldest beyond ``MAX_CHANNELS`` are closed)."""
        token = os.urandom(TOKEN_BYTES)
        channel = _Channel()
        with self._lock:
            old = self._channels.pop(peer, None)
            if old is not None:
                old.close()
            while len(self._channels) >= MAX_CHANNELS:
                self._channels.pop(next(iter(self._channels))).close()
            while len(self._tokens) >= MAX_CHANNELS:
                self._tokens.pop(next(iter(self._tokens)))
            self._channels[peer] = channel
            self._tokens[token] = channel
        return token

    def send(self, peer: bytes, job: SendJob) -> bool:
        """Queues ``job`` on ``peer``'s channel (sent once it connected). False: ``peer`` has no open channel."""
        with self._lock:
            channel = self._channels.get(peer)
        if channel is None or channel.closed:
            return False
        channel.jobs.put(job)
        return True

    def close(self) -> None:
        """Stops listening and closes every channel."""
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
            self._tokens.clear()
        for channel in channels:
            channel.close()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return  # NOTE: closed
            threading.Thread(target=self._serve, args=(sock,), name="tandem-kv-data", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        set_timeouts(sock, self.timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with sock:
            try:
                token = _recv_exactly(sock, TOKEN_BYTES)
            except OSError:
                token = b""
            with self._lock:
                channel = self._tokens.pop(token, None) if len(token) == TOKEN_BYTES else None
                if channel is None:
                    self.num_refused += 1
            if channel is None or channel.closed:
                logger.warning("KV transfer: refused a data connection without a valid token (%d refused so far)",
                               self.num_refused)
                return
            channel.sock = sock
            self._run(channel, sock)

    def _run(self, channel: _Channel, sock: socket.socket) -> None:
        staging = [np.empty(0, dtype=np.uint8)]
        while True:
            job = channel.jobs.get()
            if job is None or channel.closed:
                return
            try:
                if not self._reply(sock, job, staging):
                    logger.warning("KV transfer: pull %d outlived its lease; closing the data connection", job.xfer_id)
                    channel.close()
                    return
            except Exception as e:  # noqa: BLE001 - any failure ends this connection only
                logger.warning("KV transfer: sending pull %d failed: %s", job.xfer_id, e)
                channel.close()
                return

    def _reply(self, sock: socket.socket, job: SendJob, staging: list[np.ndarray]) -> bool:
        """Sends one reply. False: the deadline passed before the end (the reply is left unfinished)."""
        if job.reason is not None:
            reason = job.reason.encode()
            sock.sendall(HEADER.pack(FAIL, job.xfer_id, len(reason)) + reason)
            return True
        total = sum(f.nbytes if isinstance(f, memoryview) else len(f.index) * f.rows.shape[1] for f in job.frames)
        sock.sendall(HEADER.pack(DATA, job.xfer_id, total))
        for frame in job.frames:
            if time.monotonic() > job.deadline:
                return False
            self._send_frame(sock, frame, staging)
        if time.monotonic() > job.deadline:
            return False
        sock.sendall(HEADER.pack(DONE, job.xfer_id, total))
        return True


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            break
        got += k
    return bytes(buf[:got])
