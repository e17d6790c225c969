"""``tandem serve --disaggregate``: one prefill server and one decode server on split cores, one port.

The allowed CPUs are split in two halves (the first for prefill, the rest for decode; on one core both
share it). Each half runs an ordinary ``tandem serve`` child with the caller's flags plus its own
``--port`` (free, loopback), ``--cpu-bind`` / ``--num-threads`` for its cores and a
``--kv-transfer-config`` (``kv_producer`` / ``kv_consumer`` on a free loopback ``kv_port``, a fresh
random secret in the environment); this process then serves the P/D proxy (``router/pd.py``) on the
caller's ``--host``/``--port``. A child that exits during start-up ends the whole set-up with its code;
one that exits later is started again with the same command (``Child.restart``, at most
``MAX_RESTARTS`` times each; meanwhile the proxy lets the decode server prefill, or answers 502
``decode_unreachable``).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from types import FrameType

import httpx

from tandem.config import KV_SECRET_ENV

HEALTH_TIMEOUT_S = 600.0  # a loaded machine may take minutes to import and load two servers


MAX_RESTARTS = 5  # per child; a child that keeps dying (its port taken, its model gone) is left dead


@dataclass
class Child:
    """One side: its URL, ``tandem serve`` command and environment, its process, its restarts so far."""

    url: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen
    restarts: int = 0

    def restart(self) -> int | None:
        """Starts the command again if the process exited (and ``MAX_RESTARTS`` allows): returns the exit
        code it had, or None (still running, or left dead). Changes: ``proc``, ``restarts``."""
        code = self.proc.poll()
        if code is None or self.restarts >= MAX_RESTARTS:
            return None
        self.restarts += 1
        print(f"tandem: error: the server for {self.url} exited with {code}; starting it again "
              f"({self.restarts} of {MAX_RESTARTS})", file=sys.stderr, flush=True)
        self.proc = subprocess.Popen(self.argv, env=self.env)
        return code


def keep_alive(children: list[Child], stop: threading.Event, poll_s: float = 1.0) -> None:
    """Restarts children that exit, every ``poll_s`` seconds, until ``stop`` is set (a thread's target)."""
    while not stop.wait(poll_s):
        for child in children:
            child.restart()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_cpus(cpus: list[int]) -> tuple[list[int], list[int]]:
    """(prefill cores, decode cores): the first half and the rest; one core is shared by both."""
    if len(cpus) < 2:
        return cpus, cpus
    half = len(cpus) // 2
    return cpus[:half], cpus[half:]


def child_argv(argv: list[str], port: int, cpus: list[int], role: str, kv_port: int) -> list[str]:
    """The ``tandem serve`` command of one side: the caller's flags, then this side's (argparse keeps
    the last value of a repeated flag). ``argv``: the arguments after ``serve``, without ``--disaggregate``."""
    kv = {"kv_connector": "TandemConnector", "kv_role": role, "kv_port": kv_port, "kv_ip": "127.0.0.1"}
    return [sys.executable, "-m", "tandem.cli", "serve", *argv, "--host", "127.0.0.1", "--port", str(port),
            "--cpu-bind", ",".join(map(str, cpus)), "--num-threads", str(len(cpus)),
            "--kv-transfer-config", json.dumps(kv)]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    """Raises: RuntimeError: the child exited, or was not healthy within ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server for {url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the server for {url} was not healthy after {timeout_s:.0f} s")


def serve_disaggregated(argv: list[str], host: str, port: int, min_prompt_tokens: int = 0) -> int:
    """Starts both sides, serves the proxy until SIGTERM/SIGINT, then stops both. Returns an exit code."""
    import uvicorn

    from tandem.router.pd import PDConfig, PDProxy, build_pd_app
    from tandem.worker.cpu_env import allowed_cpus

    prefill_cpus, decode_cpus = split_cpus(allowed_cpus())
    env = {**os.environ, KV_SECRET_ENV: secrets.token_hex(16)}  # NOTE: only the two children know it
    sides = []
    for role, cpus in (("kv_producer", prefill_cpus), ("kv_consumer", decode_cpus)):
        child_port = free_port()
        command = child_argv(argv, child_port, cpus, role, free_port())
        sides.append(Child(f"http://127.0.0.1:{child_port}", command, env, subprocess.Popen(command, env=env)))
    stop_watching = threading.Event()
    watcher = threading.Thread(target=keep_alive, args=(sides, stop_watching), name="tandem-pd-children",
                               daemon=True)

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    try:
        for side in sides:
            wait_healthy(side.url, side.proc)
        watcher.start()
        config = PDConfig(prefill=(sides[0].url,), decode=(sides[1].url,), min_prompt_tokens=min_prompt_tokens,
                          host=host, port=port)
        print(f"tandem: disaggregated: prefill on cores {prefill_cpus}, decode on cores {decode_cpus}; "
              f"serving on http://{host}:{port}", file=sys.stderr, flush=True)
        uvicorn.run(build_pd_app(PDProxy(config)), host=host, port=port, log_level="warning")
        return 0
    except RuntimeError as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 1
    finally:
        stop_watching.set()
        if watcher.is_alive():
            watcher.join()
        for side in sides:
            if side.proc.poll() is None:
                side.proc.send_signal(signal.SIGTERM)
        for side in sides:
            try:
                side.proc.wait(30)
            except subprocess.TimeoutExpired:
                side.proc.kill()
