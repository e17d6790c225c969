"""Helpers for the service tests: a `tandem serve` subprocess and /metrics parsing."""


from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[2]

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
API_KEY = "test-key"
MODEL = "stories"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `python -m tandem.cli serve` subprocess; its stderr goes to ``log_path``."""

    def __init__(self, model: Path, log_path: Path, *flags: str, env: dict[str, str] | None = None,
                 new_session: bool = False) -> None:
        """``new_session``: the server leads a process group of its own (so a test can signal the group)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.model = str(model)
        # NOTE: with --engine-address the engine flags belong to `tandem engine` (serve refuses them).
        engine = [] if "--engine-address" in flags else ["--dtype", "float32", "--num-threads", "1"]
        cmd = [sys.executable, "-m", "tandem.cli", "--log-level", "INFO", "serve", "--model", self.model,
               *engine, "--port", str(self.port), *flags]
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=new_session)

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not healthy after {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()

    def core_process(self) -> psutil.Process:
        """The engine-core process: a child of the server's multiprocessing fork server (or, where
        there is none, a spawned child of the server)."""
        for child in psutil.Process(self.proc.pid).children():
            cmdline = " ".join(child.cmdline())
            if "forkserver" in cmdline:
                for core in child.children():
                    return core
            elif "spawn_main" in cmdline:
                return child
        raise LookupError("no engine-core process")

    def stop(self, timeout_s: float = 30.0) -> int:
        return stop_process(self.proc, self._log, timeout_s)


class RouterProcess:
    """A `python -m tandem.cli router` subprocess in front of ``backends``; its output goes to ``log_path``."""

    def __init__(self, backends: list[str], log_path: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "tandem.cli", "--log-level", "INFO", "router", "--port", str(self.port),
               *[arg for b in backends for arg in ("--backend", b)], *flags]
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        Server.wait_healthy(self, timeout_s)  # the same /health poll

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, timeout_s: float = 15.0) -> int:
        return stop_process(self.proc, self._log, timeout_s)


def stop_process(proc: subprocess.Popen, log, timeout_s: float) -> int:
    """SIGTERM, then SIGKILL after ``timeout_s``; closes ``log``. Returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.close()
    return proc.returncode


def metric_samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` parsed with prometheus_client's own parser: (sample name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=5.0).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "instance_id")))
            samples[(s.name, labels)] = s.value
    return samples


def wait_idle(url: str, timeout_s: float = 15.0) -> dict:
    """Polls /metrics until nothing runs or waits and the KV cache is empty; returns the samples."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metric_samples(url)
        idle = (m[("tandem:num_requests_running", ())] == 0 and m[("tandem:num_requests_waiting", ())] == 0
                and m[("tandem:kv_cache_usage_perc", ())] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def sse_data(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of a Server-Sent Events response, in order."""
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


class EngineService:
    """A `python -m tandem.cli engine --listen tcp://127.0.0.1:PORT` subprocess (stories260K, float32)."""

    def __init__(self, model: Path, log_path: Path, port: int | None = None, *flags: str) -> None:
        self.port = port or free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "tandem.cli", "--log-level", "INFO", "engine", "--model", str(model),
               "--dtype", "float32", "--num-threads", "1", "--listen", self.address, *flags]
        self._log = open(log_path, "a")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_listening(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while f"listening on {self.address}" not in self.log():
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine not listening after {timeout_s} s:\n{self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, timeout_s: float = 15.0) -> int:
        return stop_process(self.proc, self._log, timeout_s)
