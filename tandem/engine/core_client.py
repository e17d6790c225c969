"""Front-end side of the engine-core process: start it, talk to it over ZeroMQ, notice its death.

Start-up is synchronous (``EngineCoreClient.start`` blocks until the core has loaded the model and
sent ``Ready``); afterwards ``attach`` moves the output socket onto the running asyncio loop.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from tandem.config import EngineConfig
from tandem.engine.core_proc import (
    AbortRequests,
    AddRequests,
    CoreFailed,
    InputMessage,
    OutputMessage,
    Ready,
    Shutdown,
    WireRequest,
    make_encoder,
    run_engine_core,
)
from tandem.errors import EngineRequestError
from tandem.request import Request

logger = logging.getLogger(__name__)

INPUT_HWM = 10_000  # messages queued towards the core before a send would block (ZeroMQ's default is 1000)
ABORT_RETRY_S = 0.01  # how soon aborts that met a full input queue are sent again
BUSY_RETRY_AFTER_S = 1.0  # Retry-After of a 429 for a full input queue


def _process_context() -> multiprocessing.context.BaseContext:
    """Where core processes come from: a fork server that imported torch once (``spawn`` where there
    is no fork server).

    NOTE: a fresh interpreter spends seconds importing torch (over 10 s on a busy 2-core machine),
    which is most of a restart; forking from a server that holds torch imported, and has run nothing
    with it (no OpenMP threads yet), takes milliseconds. ``fork_server_init`` makes the server ignore
    SIGTERM (see there). The preload list is the stdlib's process-wide
    setting; it only matters before the fork server starts, which this does on first use.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tandem.engine.fork_server_init", "torch"])  # NOTE: the first ignores SIGTERM
    return ctx


class EngineCoreStartError(RuntimeError):
    """The engine-core process died or failed while loading the model."""


class EngineCoreClient:
    """Owns the engine-core process and both sockets. Not thread-safe: use from the event loop.

    Args:
        proc: the started process; ``tmp_dir`` holds its ``ipc://`` socket files.
    """

    def __init__(
        self, proc: multiprocessing.process.BaseProcess, ctx: zmq.Context, inputs: zmq.Socket,
        outputs: zmq.Socket, tmp_dir: str,
    ) -> None:
        self.proc = proc
        self.ctx = ctx
        self.inputs = inputs
        self._sync_outputs = outputs
        self.outputs: zmq.asyncio.Socket | None = None
        self.tmp_dir = tmp_dir
        self.encoder = make_encoder()
        self.decoder = msgspec.msgpack.Decoder(OutputMessage)
        self._check_decoder = msgspec.msgpack.Decoder(InputMessage)  # the core's, to check an add first
        self.max_model_len = 0
        self.num_blocks = 0
        self.block_size = 0
        self._pending_aborts: list[str] = []  # aborts that met a full input queue, sent in order later
        self._retry: asyncio.TimerHandle | None = None
        self._watch: tuple[asyncio.AbstractEventLoop, int] | None = None
        self.kernel_backend = "torch"  # the core's kernel path (``tandem/kernels/registry.py``), from Ready
        self.kernel_message = ""
        self.kv_events: dict[str, str] | None = None  # where the core publishes KV events, from Ready
        self.core_pid: int | None = None  # the core's pid and host as it reported them, from Ready
        self.core_host: str | None = None

    @classmethod
    def start(
        cls, model_dir: Path, config: EngineConfig, log_level: str = "WARNING", cpus: list[int] | None = None,
        rank: int = 0,
    ) -> EngineCoreClient:
        """Spawns the core process; it loads the model while the caller goes on (see ``wait_ready``).

        ``cpus``: the cores the core process may use (default: this process's mask at spawn time; a
        restarted core passes the mask the server had before it pinned its front end). ``rank``: the
        data-parallel rank (``run_engine_core``).
        """
        tmp_dir = tempfile.mkdtemp(prefix="tandem-")
        input_addr, output_addr = f"ipc://{tmp_dir}/input", f"ipc://{tmp_dir}/output"
        ctx = zmq.Context()
        inputs = ctx.socket(zmq.PUSH)
        inputs.setsockopt(zmq.LINGER, 0)
        inputs.setsockopt(zmq.SNDHWM, INPUT_HWM)
        inputs.bind(input_addr)
        outputs = ctx.socket(zmq.PULL)
        outputs.setsockopt(zmq.LINGER, 0)
        outputs.bind(output_addr)
        proc = _process_context().Process(
            target=run_engine_core, name="tandem-engine-core", daemon=True,
            args=(model_dir, config, input_addr, output_addr, os.getpid(), log_level, cpus, rank),
        )
        proc.start()
        return cls(proc, ctx, inputs, outputs, tmp_dir)

    @classmethod
    def launch(
        cls, model_dir: Path, config: EngineConfig, log_level: str = "WARNING", cpus: list[int] | None = None,
        timeout_s: float | None = None, rank: int = 0,
    ) -> EngineCoreClient:
        """``start`` then ``wait_ready`` (blocking); closes the process again if it fails.

        Raises:
            EngineCoreStartError: see ``wait_ready``.
        """
        client = cls.start(model_dir, config, log_level, cpus, rank)
        try:
            client.wait_ready(timeout_s)
        except BaseException:
            client.close()
            raise
        return client

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Blocks until the core has loaded the model; sets ``max_model_len``, ``num_blocks``, ``kernel_backend``
        and ``kernel_message``.

        Raises:
            EngineCoreStartError: the process exited, reported a failure, or ``timeout_s`` passed.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._sync_outputs.poll(200):
            if not self.proc.is_alive():
                raise EngineCoreStartError(
                    f"the engine core exited with code {self.proc.exitcode} while loading")
            if deadline is not None and time.monotonic() > deadline:
                raise EngineCoreStartError(f"the engine core was not ready after {timeout_s} s")
        message = self.decoder.decode(self._sync_outputs.recv())
        if isinstance(message, CoreFailed):
            raise EngineCoreStartError(f"the engine core failed to start: {message.message}")
        if not isinstance(message, Ready):
            raise EngineCoreStartError(f"unexpected first message from the engine core: {message!r}")
        self.take_ready(message)
        logger.info("engine core pid %d ready: max_model_len %d, %d KV blocks",
                    self.proc.pid, self.max_model_len, self.num_blocks)

    def take_ready(self, ready: Ready) -> None:
        """Records the core's limits, kernel path and KV events endpoints from its ``Ready``."""
        self.max_model_len, self.num_blocks, self.block_size = ready.max_model_len, ready.num_blocks, ready.block_size
        self.kernel_backend, self.kernel_message = ready.kernel_backend, ready.kernel_message
        self.core_pid, self.core_host = ready.pid or None, ready.host or None
        self.kv_events = None if not ready.kv_events_endpoint else {
            "endpoint": ready.kv_events_endpoint, "replay_endpoint": ready.kv_events_replay_endpoint,
            "topic": ready.kv_events_topic}

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def attach(self, on_death: Callable[[], None]) -> None:
        """Binds the output socket to the running loop; ``on_death`` runs once when the process ends."""
        loop = asyncio.get_running_loop()
        self.outputs = zmq.asyncio.Socket.from_socket(self._sync_outputs)
        sentinel = self.proc.sentinel
        self._watch = (loop, sentinel)

        def _dead() -> None:
            self._unwatch()
            on_death()

        loop.add_reader(sentinel, _dead)

    def _unwatch(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch[0].remove_reader(watch[1])

    def detach(self) -> None:
        """Stops watching the process and closes the loop's output socket. Call it on the loop before
        ``close`` runs in another thread. Idempotent.

        NOTE: the loop's selector holds the socket's file descriptor; closed elsewhere, the number is
        reused by the next core's socket while the stale registration still points at this one.
        """
        self._unwatch()
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self.outputs is not None:
            self.outputs.close(linger=0)
            self.outputs = None

    async def get_output(self) -> OutputMessage:
        """The next message from the core (waits without blocking the loop)."""
        assert self.outputs is not None, "attach() first"
        frame = await self.outputs.recv(copy=False)
        return self.decoder.decode(frame.buffer)

    def _send(self, message: InputMessage) -> None:
        """Sends without waiting. Raises: zmq.Again when the input queue is at its high-water mark
        (or no core is connected); zmq.ZMQError when the socket is closed."""
        # NOTE: never a blocking send: it would hold the event loop (and every other request).
        self.inputs.send(self.encoder.encode(message), zmq.NOBLOCK, copy=False)

    def add_requests(self, parent_id: str, requests: list[Request]) -> None:
        """Sends all children of one prompt; the core answers with one ``AddResult``.

        Raises:
            EngineRequestError: 429 (with ``retry_after``) when the core's input queue is full.
        """
        wire = [
            WireRequest(r.request_id, r.prompt_token_ids, r.sampling_params, sorted(r.eos_token_ids),
                        r.max_tokens, r.arrival_time)
            for r in requests
        ]
        data = self.encoder.encode(AddRequests(parent_id, wire))
        try:
            # NOTE: the core's decoder is strict and a message it cannot decode stops it: a field of the
            # wrong type that got past the front end's checks is this request's 400, not a core restart.
            self._check_decoder.decode(data)
        except msgspec.ValidationError as e:
            raise EngineRequestError(400, f"the request has a field of the wrong type: {e}") from None
        self.flush_aborts()  # NOTE: aborts first: they free KV blocks the new request may need
        try:
            self.inputs.send(data, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise EngineRequestError(429, "the engine core is busy (its input queue is full); retry later",
                                     BUSY_RETRY_AFTER_S) from None

    def abort_requests(self, request_ids: list[str]) -> None:
        """Queues an abort for these engine requests and sends it now if the input queue has room;
        otherwise it is retried every ``ABORT_RETRY_S`` s on the running loop until sent, so an abort is
        never lost (the core would keep the request's KV blocks until it finished). Never raises."""
        if request_ids:
            self._pending_aborts.extend(request_ids)
            self.flush_aborts()

    @property
    def num_pending_aborts(self) -> int:
        """Engine request ids whose abort is not sent yet."""
        return len(self._pending_aborts)

    def flush_aborts(self) -> None:
        """Sends the queued aborts as one message; on a full queue schedules a retry. Changes:
        ``num_pending_aborts`` drops to 0 once sent."""
        self._retry = None
        if not self._pending_aborts or self.inputs.closed:
            return
        try:
            self._send(AbortRequests(list(self._pending_aborts)))
        except zmq.Again:
            self._schedule_retry()
            return
        self._pending_aborts.clear()

    def _schedule_retry(self) -> None:
        if self._retry is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # NOTE: no loop (start-up or tests): the next add or abort flushes them
        self._retry = loop.call_later(ABORT_RETRY_S, self.flush_aborts)

    def close(self, timeout_s: float = 5.0) -> None:
        """Asks the core to exit, waits up to ``timeout_s``, then kills it; removes the socket files.

        Idempotent."""
        if self.ctx.closed:
            return
        if self.proc.is_alive():
            try:
                self._send(Shutdown())
            except zmq.ZMQError:
                pass
            self.proc.join(timeout_s)
            if self.proc.is_alive():
                logger.warning("engine core did not exit in %.0f s; killing it", timeout_s)
                self.proc.kill()
                self.proc.join(5.0)
        for sock in (self.inputs, self._sync_outputs):
            sock.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
