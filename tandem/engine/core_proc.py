"""The engine-core process: receives add/abort over ZeroMQ, steps EngineCore while work exists, and
sends each step's ``EngineCoreOutput``s plus a stats snapshot back to the front end.

Wire format: msgpack via ``msgspec`` into the typed messages of ``core_messages.py`` (re-exported
here; never pickle from a socket). The front end binds two ``ipc://`` sockets; this process connects a
PULL socket for inputs and a PUSH socket for outputs. It exits on a ``Shutdown`` message, when its
parent disappears, or after reporting a ``CoreFailed`` message if the engine raises.

Importing this module must not import torch (the front end imports it for the message types);
``EngineCore`` is imported inside ``run_engine_core``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from tandem.config import EngineConfig
from tandem.engine.core_messages import (
    AbortRequests,
    AddRequests,
    AddResult,
    CoreFailed,
    CoreStats,
    InputMessage,
    OutputMessage,
    Ready,
    Shutdown,
    StepFailed,
    StepOutputs,
    WireRequest,
    make_encoder,
)
from tandem.errors import DuplicateRequestError, EngineStepError
from tandem.kv_cache.events import KVEventBatch, KVEventPublisher
from tandem.request import Request

__all__ = [
    "AbortRequests", "AddRequests", "AddResult", "CoreFailed", "CoreStats", "EngineCoreProc", "InputMessage",
    "OutputMessage", "Ready", "Shutdown", "StepFailed", "StepOutputs", "WireRequest", "make_encoder", "make_ready",
    "run_engine_core",
]

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 500  # how often an idle core checks that its parent is still alive
STALLED_POLL_MS = 50  # longest wait of a core whose requests all wait (remote KV, free blocks, leases)


class EngineCoreProc:
    """The busy loop around one ``EngineCore``: drain inputs, step while work exists, send outputs.

    Args:
        core: the engine (already built; this class only drives it).
        inputs / outputs: connected ZeroMQ PULL / PUSH sockets.
        parent_pid: the pid of this process's parent (the front end, or the fork server it started);
            the loop exits once the parent is gone (the fork server leaves when the front end does).
        max_queue_len: waiting-queue bound (0 = unbounded); beyond it adds are answered 429.
        kv_publisher: publishes each step's KV events and answers snapshot / replay requests (None:
            events, if the core records them, only travel in ``StepOutputs.kv_events``).
        engine_id: the ``engine_id`` of the KV event batches (the data-parallel rank).
    """

    def __init__(
        self, core: Any, inputs: zmq.Socket, outputs: zmq.Socket, parent_pid: int, max_queue_len: int,
        kv_publisher: KVEventPublisher | None = None, engine_id: str = "0",
    ) -> None:
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.parent_pid = parent_pid
        self.max_queue_len = max_queue_len
        self.encoder = make_encoder()
        self.decoder = msgspec.msgpack.Decoder(InputMessage)
        self.live: dict[str, Request] = {}  # requests in the engine, for per-step token and queue stats
        self.unscheduled: set[str] = set()  # live requests not yet scheduled once (queue time pending)
        self.poller = zmq.Poller()
        self.poller.register(inputs, zmq.POLLIN)
        for sock in getattr(getattr(core, "kv_connector", None), "sockets", ()):  # NOTE: KV transfers wake it too
            self.poller.register(sock, zmq.POLLIN)
        self.stalled = False  # the last step scheduled nothing (requests wait for remote KV or blocks)
        self.last_idle_stats: CoreStats | None = None
        self.kv_publisher = kv_publisher
        self.engine_id = engine_id
        if kv_publisher is not None and kv_publisher.poll_socket is not None:
            self.poller.register(kv_publisher.poll_socket, zmq.POLLIN)  # NOTE: a snapshot request wakes the loop

    def send(self, message: OutputMessage) -> None:
        self.outputs.send(self.encoder.encode(message), copy=False)

    def run(self) -> None:
        """Loops until ``Shutdown`` or the parent's death. Changes: the engine's queues and cache."""
        while True:
            busy = self.core.has_unfinished_requests()
            timeout = (STALLED_POLL_MS if self.stalled else 0) if busy else IDLE_POLL_MS
            handled, stop = self.drain_inputs(timeout)
            if stop or os.getppid() != self.parent_pid:
                return
            if self.core.has_unfinished_requests():
                self.step()
            else:
                self.stalled = False
                self.core.on_idle()  # KV transfers, lease expiry and a rate-limited integrity check
                self.send_failed()
                stats, kv_events = self.stats(), self.take_kv_events()
                # NOTE: an expired lease or a served KV pull changes the stats with no input: send them too.
                if handled or stats != self.last_idle_stats or kv_events is not None:
                    self.send(StepOutputs([], stats, kv_events=kv_events))
                self.last_idle_stats = stats
            self.serve_kv_requests()

    def drain_inputs(self, timeout_ms: int) -> tuple[bool, bool]:
        """Handles every queued input message. Returns (handled any, shutdown requested)."""
        handled = False
        if not self.poller.poll(timeout_ms):
            return False, False
        while True:
            try:
                reached, stop = self.receive()
            except zmq.Again:
                return handled, False
            handled = handled or reached
            if stop:
                return True, True

    def receive(self) -> tuple[bool, bool]:
        """Reads and applies one queued message. Returns (it reached the engine, shutdown requested).

        Raises: zmq.Again when none is queued."""
        frame = self.inputs.recv(zmq.NOBLOCK, copy=False)
        return True, self.handle(self.decoder.decode(frame.buffer))

    def handle(self, message: InputMessage) -> bool:
        """Applies one input message (an add is answered with its ``AddResult``). Returns True on
        ``Shutdown``."""
        if isinstance(message, Shutdown):
            return True
        if isinstance(message, AbortRequests):
            self.abort(message.request_ids)
        else:
            self.send(self.add(message))
        return False

    def add(self, message: AddRequests) -> AddResult:
        """Queues all children of one prompt, or none: 429 past ``max_queue_len``, 400 if it can't fit
        (more children than ``max_queue_len``, or a request the engine refuses) or has a non-zero
        ``priority`` while the scheduling policy is not "priority"."""
        n = len(message.requests)
        if self.max_queue_len and n > self.max_queue_len:
            return AddResult(
                message.parent_id, 400,
                f"this request needs {n} engine requests but the waiting queue holds at most "
                f"{self.max_queue_len} (--max-queue-len); it can never be accepted",
            )
        if self.max_queue_len and self.core.stats().num_waiting + n > self.max_queue_len:
            return AddResult(
                message.parent_id, 429,
                f"the waiting queue is full ({self.max_queue_len} requests); retry later",
            )
        priority = message.requests[0].sampling_params.priority if message.requests else 0
        if priority != 0 and (policy := self.core.scheduler.config.policy) != "priority":
            # NOTE: vLLM refuses it too: a client asking for an order it would not get should know.
            return AddResult(message.parent_id, 400, f"Got priority {priority} but priority scheduling is not "
                             f"enabled (this server's --scheduling-policy is {policy})")
        added: list[str] = []
        for w in message.requests:
            request = Request(
                request_id=w.request_id, prompt_token_ids=w.prompt_token_ids,
                sampling_params=w.sampling_params, eos_token_ids=frozenset(w.eos_token_ids),
                arrival_time=w.arrival_time, max_tokens=w.max_tokens,
            )
            try:
                self.core.add_request(request)
            except ValueError as e:
                self.abort(added)
                return AddResult(message.parent_id, 400, str(e), _error_code(e))
            added.append(w.request_id)
            self.live[w.request_id] = request
            self.unscheduled.add(w.request_id)
        return AddResult(message.parent_id, 200)

    def abort(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)
        for rid in request_ids:
            self.live.pop(rid, None)
            self.unscheduled.discard(rid)

    def step(self) -> None:
        """One engine step; sends its outputs with the tokens it computed and new queue times."""
        before = {rid: r.num_computed_tokens for rid, r in self.live.items()}
        try:
            outputs = self.core.step()
        except EngineStepError as e:
            # NOTE: the core rolled the step back and logged it; only its requests fail.
            self.abort(e.request_ids)
            cause = e.__cause__ if e.__cause__ is not None else e
            self.send(StepFailed(list(e.request_ids), f"{type(cause).__name__}: {cause}"))
            kv_events = self.take_kv_events()  # NOTE: the step may have evicted cached blocks
            if kv_events is not None:
                self.send(StepOutputs([], self.stats(), kv_events=kv_events))
            return
        self.send_failed()
        num_tokens = sum(max(0, r.num_computed_tokens - before[rid]) for rid, r in self.live.items())
        self.stalled = num_tokens == 0 and not outputs
        if self.stalled:
            # NOTE: nothing ran; the loop waits for an input or a KV transfer to finish. Blocks whose
            # remote KV arrived may have entered the prefix cache: their events still go out.
            kv_events = self.take_kv_events()
            if kv_events is not None:
                self.send(StepOutputs([], self.stats(), kv_events=kv_events))
            return
        queue_times = {}
        for rid in list(self.unscheduled):
            request = self.live[rid]
            if request.first_scheduled_time is not None:
                queue_times[rid] = max(0.0, request.first_scheduled_time - request.arrival_time)
                self.unscheduled.discard(rid)
        for out in outputs:
            if out.finish_reason is not None:
                self.live.pop(out.request_id, None)
                self.unscheduled.discard(out.request_id)
        self.send(StepOutputs(outputs, self.stats(), num_tokens, queue_times, self.take_kv_events()))

    def take_kv_events(self) -> KVEventBatch | None:
        """The core's KV events since the last call, published on the way (None: none, or events off)."""
        batch = self.core.take_kv_events(self.engine_id) if hasattr(self.core, "take_kv_events") else None
        if batch is not None and self.kv_publisher is not None:
            self.kv_publisher.publish(batch)
        return batch

    def serve_kv_requests(self) -> None:
        """Answers queued KV snapshot / replay requests (``kv_cache/events.py``) between steps."""
        if self.kv_publisher is not None:
            self.kv_publisher.serve_requests(lambda: self.core.kv_snapshot(self.engine_id))

    def send_failed(self) -> None:
        """Ends the requests the engine ended with an error: a failed grammar (400), a KV transfer the
        connector gave up on (503)."""
        take = getattr(self.core, "take_failed_requests", None)  # NOTE: an injected core may have none
        for rid, message, status in take() if take is not None else ():
            self.live.pop(rid, None)
            self.unscheduled.discard(rid)
            self.send(StepFailed([rid], message, status))

    def stats(self) -> CoreStats:
        return msgspec.convert(self.core.stats(), CoreStats, from_attributes=True)


def _error_code(e: ValueError) -> str:
    """The ``AddResult.code`` of a refused request, from the error's type (never its text)."""
    if isinstance(e, DuplicateRequestError):
        return "duplicate_request_id"
    return getattr(e, "code", "") or ""


def run_engine_core(
    model_dir: Path, config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int, log_level: str,
    cpus: list[int] | None = None, rank: int = 0,
) -> None:
    """Entry point of the spawned engine-core process (see the module docstring). ``cpus``: the
    affinity mask to take before anything else (None: keep the inherited one). ``rank``: the
    data-parallel rank (the KV events' ``engine_id`` and endpoint offset, ``KVEventsConfig.for_rank``).

    SIGINT and SIGTERM are ignored: the front end drains in-flight requests on SIGTERM and then
    sends ``Shutdown``; the process also leaves on its own when the front end dies.
    """
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _release_fork_server()
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(input_addr)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 1000)
    outputs.connect(output_addr)
    try:
        _serve_core(model_dir, config, inputs, outputs, rank)
    finally:
        outputs.close(linger=1000)
        inputs.close(linger=0)  # NOTE: every socket must be closed, or ctx.term() waits forever
        ctx.term()


def _release_fork_server() -> None:
    """Closes this process's copy of the fork server's liveness pipe.

    CPython's fork server hands each child it forks the write end of the pipe whose end-of-file tells
    the fork server that its front end is gone (``multiprocessing.forkserver``). A core holding it
    keeps the fork server alive after the front end dies (``kill -9``), and the core, whose loop
    leaves when its parent (the fork server) does, then runs on as an orphan with its memory. Closed,
    the fork server exits with the front end and the core follows. No-op outside a fork-server child.
    """
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is None:
        return
    try:
        os.close(fd)
    except OSError:
        pass
    server._forkserver_alive_fd = None


def _serve_core(model_dir: Path, config: EngineConfig, inputs: zmq.Socket, outputs: zmq.Socket, rank: int) -> None:
    """Loads the engine, sends ``Ready`` and runs the loop; a failure is sent as ``CoreFailed``.

    Raises: SystemExit(1) after any exception (loading or serving)."""
    encoder = make_encoder()
    ready = False
    publisher = None
    try:
        from tandem.engine.core import EngineCore

        t0 = time.monotonic()
        # NOTE: bound before the model loads, so an endpoint in use fails at once.
        publisher = KVEventPublisher.from_config(config.kv_events, rank) if config.kv_events else None
        core = EngineCore(model_dir, config)
        logger.info("engine core (pid %d) ready in %.1f s", os.getpid(), time.monotonic() - t0)
        outputs.send(encoder.encode(make_ready(core, config, publisher)))
        ready = True
        # NOTE: the parent may be the front end's fork server (see core_client), not the front end.
        try:
            EngineCoreProc(core, inputs, outputs, os.getppid(), config.scheduler.max_queue_len, publisher,
                           str(rank)).run()
        finally:
            core.close()
    except Exception as e:
        # NOTE: a bad flag or model while loading (ValueError, FileNotFoundError) is the user's to fix:
        # the front end prints the one-line message. Anything else is a bug: its traceback is logged
        # here, once. Either way the process leaves at once (the front end does not wait for it).
        if ready or not isinstance(e, ValueError | FileNotFoundError):
            logger.exception("engine core failed")
        outputs.send(encoder.encode(CoreFailed(f"{type(e).__name__}: {e}")))
        raise SystemExit(1) from e
    finally:
        if publisher is not None:
            publisher.close()


def make_ready(core: Any, config: EngineConfig, publisher: KVEventPublisher | None, model: str = "",
               vocab_size: int = 0) -> Ready:
    """The ``Ready`` message of a loaded core: its limits, kernel path and KV events endpoints."""
    kernels = core.runner.kernel_status
    events = {} if publisher is None else {
        "kv_events_endpoint": publisher.endpoint, "kv_events_replay_endpoint": publisher.replay_endpoint or "",
        "kv_events_topic": publisher.topic.decode()}
    return Ready(core.max_model_len, getattr(core, "num_blocks", 0), config.cache.block_size, model, vocab_size,
                 kernels.backend, kernels.message, **events, pid=os.getpid(), host=socket.gethostname())
