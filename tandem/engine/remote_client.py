"""The front end's side of a networked engine core (``tandem engine``, ``core_service.py``).

``RemoteEngineCoreClient`` is an ``EngineCoreClient`` whose core is at ``tcp://host:port`` instead
of in a child process: one DEALER socket carries both directions, ``connect`` runs the handshake of
``handshake.py`` and returns once the core sent ``Ready``. Once attached to the loop it heartbeats
every second and declares the core lost when the TCP connection drops (a ZeroMQ socket monitor sees
it at once), when the core refuses us, or when nothing arrives for ``heartbeat_timeout_s``.
``RemoteCoreSupervisor`` then fails the in-flight requests and reconnects until the core is back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from tandem.config import parse_tcp_address
from tandem.engine.core_client import INPUT_HWM, EngineCoreClient, EngineCoreStartError
from tandem.engine.core_proc import AddResult, CoreFailed, OutputMessage, Ready, StepFailed, StepOutputs
from tandem.engine.handshake import HEARTBEAT_INTERVAL_S, Challenge, Goodbye, Heartbeat, Hello, Proof, Refused, sign
from tandem.engine.supervisor import CoreSupervisor
from tandem.errors import EngineDeadError, EngineRequestError
from tandem.request import Request

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0  # connection + handshake at start-up
RECONNECT_TIMEOUT_S = 2.0  # one reconnection attempt
RECONNECT_INTERVAL_S = 1.0  # pause between reconnection attempts
HEARTBEAT_TIMEOUT_S = 30.0  # the core is lost after this long without a message (a step may take seconds)
RECONNECT_RETRY_AFTER_S = 2.0  # Retry-After of a 503 while the core is unreachable
RECV_RECHECK_S = 0.25  # the reader looks for a message at least this often (a send can take its wake-up)
AWAY_RETRY_AFTER_S = 10.0  # Retry-After of a 503 while the core is away for a known reason (EngineCoreAwayError)

RemoteOutput = Ready | AddResult | StepOutputs | CoreFailed | StepFailed | Challenge | Refused | Heartbeat


class EngineRefusedError(EngineCoreStartError):
    """The engine core refused this front end (wrong or missing secret, another front end connected)."""


class EngineCoreAwayError(EngineCoreStartError):
    """The engine core cannot be reached for a known reason that may pass (e.g. its Ray cluster is lost and
    will be joined again): the supervisor keeps reconnecting, and new requests get 503 with this message."""


class EngineCoreGoneError(EngineCoreStartError):
    """The engine core will not come back (e.g. the Ray cluster that ran it is gone): the supervisor stops
    reconnecting and the server answers 503 with this message until it is restarted."""


class RemoteEngineCoreClient(EngineCoreClient):
    """A connected, admitted engine core at ``address``. Use from the event loop once attached.

    Args:
        address: ``tcp://host:port`` of the core; ``ctx`` / ``sock``: its context and DEALER socket.
        heartbeat_timeout_s: seconds without any message after which the core counts as lost.
    """

    def __init__(self, address: str, ctx: zmq.Context, sock: zmq.Socket,
                 heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
        super().__init__(None, ctx, sock, sock, "")  # type: ignore[arg-type]
        self.address = address
        self.decoder = msgspec.msgpack.Decoder(RemoteOutput)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.model = ""
        self.vocab_size = 0
        self.loss_reason = ""
        self._last_seen = time.monotonic()
        self._monitor: zmq.asyncio.Socket | None = None
        self._watchdog: asyncio.Task | None = None
        self._admitted = False  # NOTE: only an admitted front end says Goodbye (others would be refused again)
        self.report_loss: Callable[[str], None] | None = None  # logs a loss (None: an ERROR); called on the loop

    @classmethod
    def connect(cls, address: str, secret: bytes | None, timeout_s: float = CONNECT_TIMEOUT_S,
                heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> RemoteEngineCoreClient:
        """Connects and passes the handshake (blocking, at most ``timeout_s`` seconds).

        Raises:
            EngineRefusedError: the core refused this front end (its reason in the message).
            EngineCoreStartError: no core answered within ``timeout_s`` or it answered nonsense.
        """
        host, _ = parse_tcp_address(address)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, INPUT_HWM)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # NOTE: no queueing towards a core that is not connected
        sock.setsockopt(zmq.IPV6, 1 if ":" in host else 0)
        sock.connect(address)
        client = cls(address, ctx, sock, heartbeat_timeout_s)
        try:
            client._handshake(secret, time.monotonic() + timeout_s)
        except BaseException:
            client.close()
            raise
        return client

    def _handshake(self, secret: bytes | None, deadline: float) -> None:
        self._send_sync(Hello(), deadline)
        challenge = self._recv_sync(deadline)
        if not isinstance(challenge, Challenge):
            raise EngineCoreStartError(f"unexpected answer to Hello from {self.address}: {challenge!r}")
        if secret is None and challenge.auth:
            logger.warning("the engine core at %s requires a secret and none is set", self.address)
        self._send_sync(Proof(sign(secret, challenge.nonce) if secret is not None else b""), deadline)
        ready = self._recv_sync(deadline)
        if not isinstance(ready, Ready):
            raise EngineCoreStartError(f"unexpected answer to Proof from {self.address}: {ready!r}")
        self.take_ready(ready)
        self.model, self.vocab_size = ready.model, ready.vocab_size
        self._admitted = True
        logger.info("connected to the engine core at %s (%s): max_model_len %d, %d KV blocks", self.address,
                    self.model, self.max_model_len, self.num_blocks)

    def _send_sync(self, message: object, deadline: float) -> None:
        if not self.inputs.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLOUT):
            raise EngineCoreStartError(f"no engine core answers at {self.address}")
        self.inputs.send(self.encoder.encode(message), zmq.NOBLOCK)

    def _recv_sync(self, deadline: float) -> object:
        if not self.inputs.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            raise EngineCoreStartError(f"the engine core at {self.address} did not answer the handshake")
        message = self.decoder.decode(self.inputs.recv())
        if isinstance(message, Refused):
            raise EngineRefusedError(f"the engine core at {self.address} refused this front end: {message.reason}")
        return message

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Nothing to wait for: ``connect`` returns once the core is ready."""

    @property
    def pid(self) -> int | None:
        """None: the core's process is on another host (or at least not ours)."""
        return None

    def is_alive(self) -> bool:
        """True until the connection is lost or closed."""
        return not self.loss_reason and not self.ctx.closed

    def attach(self, on_death: Callable[[], None]) -> None:
        """Moves the socket onto the running loop and starts the watchdog: ``on_death`` runs once when
        the connection is lost (``loss_reason`` says why)."""
        self.outputs = zmq.asyncio.Socket.from_socket(self.inputs)
        self._monitor = zmq.asyncio.Socket.from_socket(self.inputs.get_monitor_socket(zmq.EVENT_DISCONNECTED))
        self._last_seen = time.monotonic()
        self._watchdog = asyncio.get_running_loop().create_task(self._watch_connection(on_death),
                                                                name="tandem-engine-watchdog")

    async def _watch_connection(self, on_death: Callable[[], None]) -> None:
        assert self._monitor is not None
        while not self.loss_reason:
            if await self._monitor.poll(int(HEARTBEAT_INTERVAL_S * 1000)):
                event = parse_monitor_message(await self._monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self.lose(f"the connection to the engine core at {self.address} was lost")
            elif time.monotonic() - self._last_seen > self.heartbeat_timeout_s:
                self.lose(f"the engine core at {self.address} sent nothing for {self.heartbeat_timeout_s:g} s")
            else:
                self._send_heartbeat()
        self._watchdog = None  # NOTE: done: detach must not cancel the task that runs on_death
        on_death()

    def lose(self, reason: str) -> None:
        """Marks the core as lost (the watchdog then runs ``on_death``). Idempotent."""
        if not self.loss_reason:
            if self.report_loss is None:
                logger.error("%s", reason)
            else:
                self.report_loss(reason)
            self.loss_reason = reason

    def add_requests(self, parent_id: str, requests: list[Request]) -> None:
        """``EngineCoreClient.add_requests``; a send refused because the connection just dropped is the core's
        loss (503), not a full queue (429).

        Raises:
            EngineRequestError: 400 (a field of the wrong type), 429 (the core's input queue is full).
            EngineDeadError: the connection is lost (``lose`` runs; the watchdog then runs ``on_death``).
        """
        try:
            super().add_requests(parent_id, requests)
        except EngineRequestError as e:
            if e.status != 429 or not self._disconnect_pending():
                raise
            self.lose(f"the connection to the engine core at {self.address} was lost")
            raise EngineDeadError(f"{self.loss_reason}; reconnecting", RECONNECT_RETRY_AFTER_S) from None

    def _disconnect_pending(self) -> bool:
        """Whether the socket monitor holds a disconnect the watchdog has not read yet.

        NOTE: with ``IMMEDIATE`` a send fails (``zmq.Again``, as on a full queue) as soon as ZeroMQ's I/O thread
        drops the connection's pipe, which it does after queueing the monitor's ``EVENT_DISCONNECTED``: a request
        handled before the watchdog's turn finds the event here."""
        return self._monitor is not None and bool(self._monitor.get(zmq.EVENTS) & zmq.POLLIN)

    def _send_heartbeat(self) -> None:
        try:
            self._send(Heartbeat())
        except zmq.ZMQError:
            pass  # NOTE: a full queue is not a lost core; the heartbeat timeout decides

    async def get_output(self) -> OutputMessage:
        """The next message from the core; heartbeats are consumed here, a ``Refused`` (the core
        dropped us) becomes ``CoreFailed``."""
        assert self.outputs is not None, "attach() first"
        while True:
            # NOTE: not ``await self.outputs.recv()``: sends go through the same socket (``inputs``, not the loop's
            # wrapper), and a send made after a message arrived but before the loop's turn takes ZeroMQ's wake-up
            # for it: a reader waiting only for the wake-up would not see the message (nor any later one) until
            # something else woke it, the heartbeat timeout. So it takes what is there and waits at most
            # ``RECV_RECHECK_S`` for a wake-up before it looks again.
            try:
                frame = self.inputs.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                await self.outputs.poll(int(RECV_RECHECK_S * 1000), zmq.POLLIN)
                continue
            self._last_seen = time.monotonic()
            message = self.decoder.decode(frame.buffer)
            if isinstance(message, Refused):
                self.lose(f"the engine core at {self.address} dropped this front end: {message.reason}")
                return CoreFailed(message.reason)
            if not isinstance(message, Heartbeat | Challenge):
                return message

    def _unwatch(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._monitor is not None:
            self.inputs.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None

    def detach(self) -> None:
        """Stops the watchdog, says ``Goodbye`` and closes the socket (call on the loop). Idempotent."""
        if self.outputs is not None and self._admitted and not self.loss_reason:
            try:
                self._send(Goodbye())
            except zmq.ZMQError:
                pass
        super().detach()

    def close(self, timeout_s: float = 5.0) -> None:
        """Says ``Goodbye`` (unless ``detach`` did) and closes the socket; the remote core keeps running.
        Idempotent."""
        if self.ctx.closed:
            return
        self._unwatch()
        if not self.inputs.closed:
            if self._admitted and not self.loss_reason and self.outputs is None:
                try:
                    self._send(Goodbye())
                except zmq.ZMQError:
                    pass
            self.inputs.close(linger=200)
        self.ctx.term()


class RemoteCoreSupervisor(CoreSupervisor):
    """Supervises a remote engine core, which the server cannot restart: when it is lost, the
    in-flight requests fail (``on_lost``), new ones get 503 with ``Retry-After`` while ``start_core``
    (a reconnect) is tried every ``RECONNECT_INTERVAL_S`` until it succeeds; then ``on_ready``.
    There is no crash-loop limit: the core's operator restarts it, this side waits; ``start_core`` raising
    ``EngineCoreAwayError`` puts its reason in the 503, ``EngineCoreGoneError`` (the core cannot come back)
    stops the reconnects: then the 503 is for good."""

    def watch(self) -> None:
        client = self.client
        client.attach(lambda: self.core_died(client, getattr(client, "loss_reason", "") or "the engine core was lost"))

    def _after_death(self, reason: str) -> None:
        self.unavailable = EngineDeadError(f"{reason}; reconnecting", RECONNECT_RETRY_AFTER_S)
        logger.warning("reconnecting to the engine core every %.0f s (%s)", RECONNECT_INTERVAL_S, reason)
        self._task = asyncio.get_running_loop().create_task(self._restart(), name="tandem-core-reconnect")

    async def _restart(self) -> None:
        t0 = time.monotonic()
        await self._retire(self.client)
        attempts = 0
        while not self._closing:
            try:
                new = await asyncio.to_thread(self.start_core)  # type: ignore[arg-type]
            except EngineCoreGoneError as e:
                self.permanent = True
                self.unavailable = EngineDeadError(str(e))
                logger.warning("stopped reconnecting to the engine core at %s: it cannot come back",
                               getattr(self.client, "address", "?"))
                return
            except EngineCoreStartError as e:
                if isinstance(e, EngineCoreAwayError):
                    self.unavailable = EngineDeadError(str(e), AWAY_RETRY_AFTER_S)
                attempts += 1
                if attempts == 1 or attempts % 60 == 0:
                    logger.warning("cannot reconnect yet (attempt %d): %s", attempts, e)
                await asyncio.sleep(RECONNECT_INTERVAL_S)
                continue
            if not await self._adopt(new):
                return
            logger.warning("reconnected to the engine core after %.1f s", time.monotonic() - t0)
            self.on_ready(new)
            return
