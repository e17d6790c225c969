"""``tandem engine``: one engine core alone as a network service on ``tcp://host:port``.

It speaks the protocol of the spawned core (``core_proc``'s msgpack messages) over one ZeroMQ ROUTER
socket, so each message carries its sender's identity. A front end connects a DEALER socket and
passes the handshake of ``handshake.py`` (HMAC-SHA256 of a nonce under the shared secret) before any
add or abort reaches the engine; messages from anyone else are refused, logged and counted. One
front end is served at a time: it is dropped (its requests aborted) when it says ``Goodbye``, when it
is silent for ``PEER_TIMEOUT_S`` (it heartbeats every second) or when a send to it fails; then the
next front end may connect. The service stops on SIGTERM or SIGINT (exit 0).

Importing this module must not import torch (``EngineCore`` is imported in ``serve_engine``).
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import msgspec
import zmq

from tandem.config import EngineConfig, ParallelConfig, parse_tcp_address
from tandem.engine.core_proc import (
    IDLE_POLL_MS,
    AbortRequests,
    AddRequests,
    CoreFailed,
    EngineCoreProc,
    OutputMessage,
    Ready,
    StepOutputs,
    make_ready,
)
from tandem.engine.handshake import (
    HEARTBEAT_INTERVAL_S,
    REFUSED_UNAUTHENTICATED,
    Goodbye,
    Heartbeat,
    Hello,
    PeerGate,
    Proof,
    Refused,
)
from tandem.kv_cache.events import KVEventPublisher

logger = logging.getLogger(__name__)

SEND_TIMEOUT_MS = 5000  # a peer that reads nothing for this long (output queue full) is dropped

ServiceInput = AddRequests | AbortRequests | Hello | Proof | Heartbeat | Goodbye


class EngineCoreService(EngineCoreProc):
    """``EngineCoreProc`` behind a ROUTER socket and a ``PeerGate``. Use from one thread.

    Args:
        core: the engine (built; this class only drives it).
        sock: the bound ROUTER socket (``ROUTER_MANDATORY`` set, so a send to a gone peer raises).
        gate: who may talk to the engine.
        ready: the ``Ready`` message an admitted front end gets.
        max_queue_len: waiting-queue bound (0 = unbounded); beyond it adds are answered 429.
    """

    def __init__(self, core: Any, sock: zmq.Socket, gate: PeerGate, ready: Ready, max_queue_len: int,
                 kv_publisher: KVEventPublisher | None = None, engine_id: str = "0") -> None:
        super().__init__(core, sock, sock, 0, max_queue_len, kv_publisher, engine_id)
        self.gate = gate
        self.ready = ready
        self.decoder = msgspec.msgpack.Decoder(ServiceInput)
        self.stopping = False
        self._last_sent = 0.0

    def send(self, message: OutputMessage | Heartbeat | Refused) -> None:
        """Sends to the peer (dropped when there is none); a failed send drops the peer."""
        peer = self.gate.peer
        if peer is None:
            return
        try:
            self.outputs.send_multipart([peer, self.encoder.encode(message)], copy=False)
        except zmq.ZMQError as e:
            self.drop_peer(f"cannot send to it ({e})")
            return
        self._last_sent = time.monotonic()

    def reply(self, identity: bytes, message: Any) -> None:
        """Answers a connection that is not (or not yet) the peer; never blocks, never raises."""
        try:
            self.outputs.send_multipart([identity, self.encoder.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def drop_peer(self, reason: str) -> None:
        """Aborts the peer's requests and admits the next front end. Changes: the engine's queues."""
        if self.gate.peer is None:
            return
        logger.warning("front end%s dropped: %s; aborting its %d request(s)",
                       f" from {self.gate.peer_address}" if self.gate.peer_address else "", reason, len(self.live))
        self.gate.release()
        self.abort(list(self.live))

    def run(self) -> None:
        """Loops until ``stopping`` is set. Changes: the engine's queues and cache, the peer."""
        while not self.stopping:
            busy = self.core.has_unfinished_requests()
            handled, _ = self.drain_inputs(0 if busy else IDLE_POLL_MS)
            self.tend_peer()
            if self.core.has_unfinished_requests():
                self.step()
            else:
                self.core.on_idle()
                kv_events = self.take_kv_events()  # NOTE: idle work (KV arriving) may cache blocks
                if handled or kv_events is not None:
                    self.send(StepOutputs([], self.stats(), kv_events=kv_events))
            self.serve_kv_requests()

    def tend_peer(self) -> None:
        """Drops a silent peer; sends a heartbeat after ``HEARTBEAT_INTERVAL_S`` of silence."""
        if self.gate.expired():
            self.drop_peer(f"silent for more than {self.gate.peer_timeout_s:.0f} s")
        elif self.gate.peer is not None and time.monotonic() - self._last_sent >= HEARTBEAT_INTERVAL_S:
            self.send(Heartbeat())

    def receive(self) -> tuple[bool, bool]:
        """Reads and routes one queued message. Returns (it reached the engine, False): a front end
        cannot stop the service. Raises: zmq.Again when none is queued."""
        return self.on_frames(self.inputs.recv_multipart(zmq.NOBLOCK, copy=False)), False

    def on_frames(self, frames: list[zmq.Frame]) -> bool:
        """Routes one message from the ROUTER socket. Returns True when it reached the engine."""
        identity = frames[0].bytes
        address = _peer_address(frames[-1])
        try:
            if len(frames) != 2:
                raise msgspec.DecodeError(f"{len(frames) - 1} frames")
            message = self.decoder.decode(frames[1].buffer)
        except msgspec.MsgspecError as e:
            self.reply(identity, self.gate.refuse(identity, f"malformed message ({e})", address))
            return False
        if isinstance(message, Hello):
            self.reply(identity, self.gate.on_hello(identity, message, address))
        elif isinstance(message, Proof):
            refused = self.gate.on_proof(identity, message, address)
            if refused is None:
                self.send(self.ready)
            else:
                self.reply(identity, refused)
        elif not self.gate.seen(identity):
            if isinstance(message, Goodbye):
                return False  # NOTE: a dropped peer leaving late: nothing to refuse
            self.reply(identity, self.gate.refuse(identity, REFUSED_UNAUTHENTICATED, address))
        elif isinstance(message, Goodbye):
            self.drop_peer("it said goodbye")
        elif not isinstance(message, Heartbeat):
            self.handle(message)
            return True
        return False


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return frame.get("Peer-Address")
    except zmq.ZMQError:
        return ""


def bind_router(ctx: zmq.Context, address: str) -> zmq.Socket:
    """A ROUTER socket bound to ``address`` (``tcp://host:port``).

    Raises:
        zmq.ZMQError: the address is in use or cannot be bound.
    """
    host, _ = parse_tcp_address(address)
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    sock.setsockopt(zmq.IPV6, 1 if ":" in host else 0)
    try:
        sock.bind(address)
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    return sock


def serve_engine(model_dir: Path, config: EngineConfig, parallel: ParallelConfig, rank: int = 0) -> int:
    """Binds ``parallel.listen_address``, loads the model, serves front ends until SIGTERM/SIGINT.

    Returns 0 after a signal, 1 when the address cannot be bound (after printing why). ``rank``: the
    data-parallel rank (KV events' ``engine_id`` and endpoint offset).

    Raises:
        ValueError / FileNotFoundError: a bad config or model (the CLI prints them and exits 2).
    """
    assert parallel.listen_address is not None
    gate = PeerGate(parallel.secret())
    ctx = zmq.Context()
    try:
        try:
            sock = bind_router(ctx, parallel.listen_address)
        except zmq.ZMQError as e:
            print(f"tandem: error: cannot listen on {parallel.listen_address}: {e}", file=sys.stderr)
            return 1
        try:
            return _serve_bound(sock, gate, model_dir, config, parallel.listen_address, rank)
        finally:
            sock.close(linger=1000)
    finally:
        ctx.term()


def _serve_bound(sock: zmq.Socket, gate: PeerGate, model_dir: Path, config: EngineConfig, address: str,
                 rank: int = 0) -> int:
    from tandem.engine.core import EngineCore

    t0 = time.monotonic()
    publisher = KVEventPublisher.from_config(config.kv_events, rank) if config.kv_events else None
    try:
        core = EngineCore(model_dir, config)
        ready = make_ready(core, config, publisher, model_dir.name, core.runner.hf_config.vocab_size)
        service = EngineCoreService(core, sock, gate, ready, config.scheduler.max_queue_len, publisher, str(rank))
        return _run_service(service, gate, address, t0)
    finally:
        if publisher is not None:
            publisher.close()


def _run_service(service: EngineCoreService, gate: PeerGate, address: str, t0: float) -> int:
    """Serves until SIGTERM/SIGINT (0) or until the engine fails (1, after telling the peer)."""

    def _stop(signum: int, frame: FrameType | None) -> None:
        service.stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    print(f"tandem: engine core ready in {time.monotonic() - t0:.1f} s; listening on {address} "
          f"({'a shared secret is required' if gate.secret else 'no secret: loopback only'})",
          file=sys.stderr, flush=True)
    try:
        service.run()
    except Exception as e:
        logger.exception("engine core failed")
        service.send(CoreFailed(f"{type(e).__name__}: {e}"))
        return 1
    service.send(Refused("the engine core is shutting down"))
    service.drop_peer("the engine core is shutting down")
    print(f"tandem: engine core stopped ({gate.num_refused} connection(s) refused)", file=sys.stderr, flush=True)
    return 0
