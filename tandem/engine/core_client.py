"""Front-end side of the engine-core process: spawn it, talk to it over ZeroMQ, notice its death.

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
from tandem.request import Request

logger = logging.getLogger(__name__)


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
        self.max_model_len = 0
        self.num_blocks = 0
        self.kernel_backend = "torch"  # the core's kernel path (``tandem/kernels/registry.py``), from Ready
        self.kernel_message = ""

    @classmethod
    def start(cls, model_dir: Path, config: EngineConfig, log_level: str = "WARNING") -> EngineCoreClient:
        """Spawns the core process; it loads the model while the caller goes on (see ``wait_ready``)."""
        tmp_dir = tempfile.mkdtemp(prefix="tandem-")
        input_addr, output_addr = f"ipc://{tmp_dir}/input", f"ipc://{tmp_dir}/output"
        ctx = zmq.Context()
        inputs = ctx.socket(zmq.PUSH)
        inputs.setsockopt(zmq.LINGER, 0)
        inputs.bind(input_addr)
        outputs = ctx.socket(zmq.PULL)
        outputs.setsockopt(zmq.LINGER, 0)
        outputs.bind(output_addr)
        spawn = multiprocessing.get_context("spawn")
        proc = spawn.Process(
            target=run_engine_core, name="tandem-engine-core", daemon=True,
            args=(model_dir, config, input_addr, output_addr, os.getpid(), log_level),
        )
        proc.start()
        return cls(proc, ctx, inputs, outputs, tmp_dir)

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
        self.max_model_len = message.max_model_len
        self.num_blocks = message.num_blocks
        self.kernel_backend, self.kernel_message = message.kernel_backend, message.kernel_message
        logger.info("engine core pid %d ready: max_model_len %d, %d KV blocks",
                    self.proc.pid, self.max_model_len, self.num_blocks)

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

        def _dead() -> None:
            loop.remove_reader(sentinel)
            on_death()

        loop.add_reader(sentinel, _dead)

    async def get_output(self) -> OutputMessage:
        """The next message from the core (waits without blocking the loop)."""
        assert self.outputs is not None, "attach() first"
        frame = await self.outputs.recv(copy=False)
        return self.decoder.decode(frame.buffer)

    def _send(self, message: InputMessage) -> None:
        # NOTE: PUSH to a connected peer with a high-water mark far above our message rate: a
        # non-blocking send never waits, so the event loop is never held.
        self.inputs.send(self.encoder.encode(message), zmq.NOBLOCK, copy=False)

    def add_requests(self, parent_id: str, requests: list[Request]) -> None:
        """Sends all children of one prompt; the core answers with one ``AddResult``."""
        wire = [
            WireRequest(r.request_id, r.prompt_token_ids, r.sampling_params, sorted(r.eos_token_ids),
                        r.max_tokens, r.arrival_time)
            for r in requests
        ]
        self._send(AddRequests(parent_id, wire))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.proc.is_alive():
            self._send(AbortRequests(list(request_ids)))

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
