"""Who may use a networked engine core: the handshake messages and the gate that admits one front end.

A front end connecting to ``tandem engine`` sends ``Hello``; the core answers ``Challenge`` with a
fresh random nonce; the front end answers ``Proof`` carrying HMAC-SHA256(secret, nonce) (an empty
MAC when it has no secret); the core compares it with ``hmac.compare_digest`` and answers ``Ready``
(the front end is now *the* peer) or ``Refused``. Nothing else a peer sends reaches the engine
before that. The secret itself never crosses the wire, and a captured proof is useless for another
nonce. A core without a secret still runs the handshake (it admits any proof) so that one front end
at a time is enforced the same way.

Model-free and socket-free: ``PeerGate`` maps (identity, message) to the reply; the service sends it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable

import msgspec

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
NONCE_BYTES = 32
HANDSHAKE_TIMEOUT_S = 10.0  # a started handshake (Challenge sent) is forgotten after this many seconds
MAX_PENDING = 64  # handshakes in progress at once; older ones are dropped first
PEER_TIMEOUT_S = 5.0  # the peer is dropped after this many seconds without a message (it heartbeats every 1 s)
HEARTBEAT_INTERVAL_S = 1.0  # both sides send a Heartbeat when they have sent nothing for this long
_MAC_CONTEXT = b"tandem-engine-handshake-v1\x00"


class Hello(msgspec.Struct, tag="hello"):
    """Front end -> core: the first message of a connection."""

    protocol: int = PROTOCOL_VERSION


class Challenge(msgspec.Struct, tag="challenge"):
    """Core -> front end: prove the secret for ``nonce``. ``auth`` False: the core has no secret."""

    nonce: bytes
    auth: bool


class Proof(msgspec.Struct, tag="proof"):
    """Front end -> core: ``sign(secret, nonce)``, or b"" without a secret."""

    mac: bytes


class Refused(msgspec.Struct, tag="refused"):
    """Core -> front end: the connection is not admitted (or no longer); ``reason`` is for humans."""

    reason: str


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    """Either way: I am alive (sent after ``HEARTBEAT_INTERVAL_S`` of silence)."""


class Goodbye(msgspec.Struct, tag="goodbye"):
    """Front end -> core: I am leaving; abort my requests and admit the next front end."""


def sign(secret: bytes, nonce: bytes) -> bytes:
    """HMAC-SHA256 of ``nonce`` (with a fixed context prefix) under ``secret``: 32 bytes."""
    return hmac.new(secret, _MAC_CONTEXT + nonce, hashlib.sha256).digest()


REFUSED_SECRET = "wrong or missing engine secret"
REFUSED_BUSY = "the engine core already serves another front end (one front end per core)"
REFUSED_UNAUTHENTICATED = "not authenticated: send Hello and a Proof first"


class PeerGate:
    """Admits at most one authenticated front end (the peer) at a time. Not thread-safe.

    Args:
        secret: the shared secret, or None to admit any proof (loopback only; ``ParallelConfig``
            enforces that).
        clock: monotonic seconds (injectable for tests).
        peer_timeout_s: the peer is dropped by ``expire`` after this long without ``seen``.

    Changes: ``peer``, the pending handshakes, ``num_refused``.
    """

    def __init__(self, secret: bytes | None, clock: Callable[[], float] = time.monotonic,
                 peer_timeout_s: float = PEER_TIMEOUT_S) -> None:
        self.secret = secret
        self.clock = clock
        self.peer_timeout_s = peer_timeout_s
        self.peer: bytes | None = None
        self.peer_address = ""
        self._peer_seen = 0.0
        self._pending: dict[bytes, tuple[bytes, float]] = {}  # identity -> (nonce, deadline)
        self.num_refused = 0

    def refuse(self, identity: bytes, reason: str, address: str = "") -> Refused:
        """Counts and logs a refusal of ``identity`` (from ``address``) and returns the reply."""
        self.num_refused += 1
        self._pending.pop(identity, None)
        logger.warning("refused a front end%s: %s (%d refused so far)", f" from {address}" if address else "",
                       reason, self.num_refused)
        return Refused(reason)

    def on_hello(self, identity: bytes, hello: Hello, address: str = "") -> Challenge | Refused:
        """Starts a handshake: a Challenge with a fresh nonce, or Refused (another protocol). Whether
        another front end is connected is only told to one that proved the secret (``on_proof``)."""
        if hello.protocol != PROTOCOL_VERSION:
            return self.refuse(identity, f"protocol {hello.protocol} is not supported (this core speaks "
                                         f"{PROTOCOL_VERSION})", address)
        self._forget_stale()
        while len(self._pending) >= MAX_PENDING:
            self._pending.pop(next(iter(self._pending)))
        nonce = os.urandom(NONCE_BYTES)
        self._pending[identity] = (nonce, self.clock() + HANDSHAKE_TIMEOUT_S)
        return Challenge(nonce, self.secret is not None)

    def on_proof(self, identity: bytes, proof: Proof, address: str = "") -> Refused | None:
        """Ends a handshake: None when ``identity`` is admitted (it becomes the peer), else Refused
        (no Challenge pending, wrong MAC, or another peer was admitted meanwhile)."""
        self._forget_stale()
        pending = self._pending.pop(identity, None)
        if pending is None:
            return self.refuse(identity, "no handshake in progress: send Hello first", address)
        if self.secret is not None and not hmac.compare_digest(proof.mac, sign(self.secret, pending[0])):
            return self.refuse(identity, REFUSED_SECRET, address)
        if self.peer is not None and self.peer != identity:
            return self.refuse(identity, REFUSED_BUSY, address)
        self.peer, self.peer_address, self._peer_seen = identity, address, self.clock()
        logger.info("front end%s connected", f" from {address}" if address else "")
        return None

    def seen(self, identity: bytes) -> bool:
        """True when ``identity`` is the peer (and notes that it is alive)."""
        if self.peer is None or identity != self.peer:
            return False
        self._peer_seen = self.clock()
        return True

    def expired(self) -> bool:
        """True when the peer has been silent for longer than ``peer_timeout_s``."""
        return self.peer is not None and self.clock() - self._peer_seen > self.peer_timeout_s

    def release(self) -> None:
        """Forgets the peer: the next front end may connect."""
        self.peer, self.peer_address = None, ""

    def _forget_stale(self) -> None:
        now = self.clock()
        for identity in [i for i, (_, deadline) in self._pending.items() if deadline < now]:
            del self._pending[identity]
