"""`tandem serve -dp 2 --data-parallel-backend ray` that starts its own local Ray cluster (no address), stopped
by signals: SIGTERM on its whole process group, as systemd's default `KillMode=control-group` sends it (the
raylet, a child in the group, exits too: the server used to hang for good in `remove_placement_group` with its
GCS and engine actors alive), idle or with streams running (it took 20 s, with a misleading ERROR); a second
SIGTERM while Ray shuts down (exit 143 before: Ray had reset SIGTERM to its default action); SIGTERM while
`ray.init` runs (exit 15 before, with Ray workers left behind). Each must exit with code 0 and leave none of the
cluster's processes running.

The cluster's temp dir is this test's own (`RAY_TMPDIR`), so the server starts a new cluster instead of joining
one another test left, and only this cluster's processes are looked at."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time

import httpx
import psutil
import pytest
from live_server import MODEL, Server

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'tandem[ray]'); the Ray backend is untested")

BODY = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}


def running(pids: set[int]) -> list[psutil.Process]:
    """The processes of ``pids`` still running (a zombie waiting for its parent to reap it has exited)."""
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def cluster_pids(server: psutil.Process, temp_dir: str) -> set[int]:
    """The server's descendants (GCS, raylet, monitors, agents, engine actors while the raylet lives) and every
    process naming the cluster's temp dir."""
    found = {c.pid for c in server.children(recursive=True)}
    for p in psutil.process_iter(["cmdline"]):
        if temp_dir in " ".join(p.info["cmdline"] or []):
            found.add(p.pid)
    return found


def _ray_server(stories_dir, tmp_path) -> tuple[Server, str]:
    if os.environ.get("RAY_ADDRESS"):
        pytest.skip("RAY_ADDRESS is set: the server would join that cluster instead of starting its own")
    temp_dir = tempfile.mkdtemp(prefix="tl-", dir="/tmp")  # NOTE: short: Ray's socket paths have a length limit
    return Server(stories_dir, tmp_path / "server.log", "-dp", "2", "--data-parallel-backend", "ray",
                  "--served-model-name", MODEL, env={"RAY_TMPDIR": temp_dir}, new_session=True), temp_dir


def _ready_pids(s: Server, temp_dir: str) -> set[int]:
    """Waits for the server and one answer; returns the cluster's processes (engine actors included)."""
    s.wait_healthy(timeout_s=300)
    r = httpx.post(f"{s.url}/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    actors = {e["pid"] for e in httpx.get(f"{s.url}/load", timeout=10).json()["engines"]}
    pids = cluster_pids(psutil.Process(s.proc.pid), temp_dir) | actors
    names = {p.name() for p in running(pids)}
    assert {"gcs_server", "raylet"} <= names, names
    assert len(actors) == 2 and not actors & {s.proc.pid}
    return pids


def _exit_code(s: Server, pids: set[int], temp_dir: str, t0: float, what: str) -> tuple[int, list, float]:
    """Waits up to 60 s for the server's exit, then up to 10 s for the cluster's processes; returns the exit
    code, the processes left and the seconds from ``t0`` to the exit. Kills whatever is left."""
    try:
        try:
            code = s.proc.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server still runs 60 s after {what}:\n{s.log()[-3000:]}")
        took = time.monotonic() - t0
        print(f"exited {took:.1f} s after {what}")
        pids = pids | cluster_pids_by_dir(temp_dir)
        deadline = time.monotonic() + 10
        while running(pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [(p.pid, p.name()) for p in running(pids)]
    finally:
        if s.proc.poll() is None:
            os.killpg(s.proc.pid, signal.SIGKILL)
        s.stop()
        for p in running(pids | cluster_pids_by_dir(temp_dir)):
            p.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)
    return code, left, took


def cluster_pids_by_dir(temp_dir: str) -> set[int]:
    found = set()
    for p in psutil.process_iter(["cmdline"]):
        if temp_dir in " ".join(p.info["cmdline"] or []):
            found.add(p.pid)
    return found


def test_sigterm_to_the_process_group_of_a_local_ray_server_exits_cleanly(stories_dir, tmp_path):
    s, temp_dir = _ray_server(stories_dir, tmp_path)
    pids: set[int] = set()
    try:
        pids = _ready_pids(s, temp_dir)
    finally:
        t0 = time.monotonic()
        if s.proc.poll() is None:
            os.killpg(s.proc.pid, signal.SIGTERM)  # the server leads its group (new_session)
        code, left, _ = _exit_code(s, pids, temp_dir, t0, "SIGTERM to its process group")
    assert code == 0, s.log()[-3000:]
    assert left == [], left
    assert "and the engine actors without Ray calls" in s.log()  # NOTE: from close, or the cluster watch first


def test_sigterm_to_the_process_group_with_streams_running_ends_them_and_exits_cleanly(stories_dir, tmp_path):
    """Streams under way when the group gets SIGTERM end with an SSE error event and [DONE] (their engine actors
    got the signal too); the server takes the local-cluster path at once, not the lost-cluster ERROR."""
    s, temp_dir = _ray_server(stories_dir, tmp_path)
    pids: set[int] = set()
    ends: list[tuple[int, str]] = []
    started = threading.Semaphore(0)

    def stream() -> None:
        body = {**BODY, "max_tokens": 400, "ignore_eos": True, "stream": True}
        try:
            for _ in range(200):  # NOTE: stories260K is fast: one stream after another until the server stops
                with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as r:
                    lines = [line for line in r.iter_lines() if line]
                    started.release()
                    if r.status_code != 200 or len(lines) < 2 or "error" in lines[-2]:
                        ends.append((r.status_code, lines[-1] if lines else ""))
                        return
        except httpx.HTTPError as e:
            ends.append((0, type(e).__name__))

    try:
        pids = _ready_pids(s, temp_dir)
        clients = [threading.Thread(target=stream, daemon=True) for _ in range(4)]
        for c in clients:
            c.start()
        for _ in clients:
            assert started.acquire(timeout=60)
    finally:
        t0 = time.monotonic()
        if s.proc.poll() is None:
            os.killpg(s.proc.pid, signal.SIGTERM)
        code, left, _ = _exit_code(s, pids, temp_dir, t0, "SIGTERM to its process group, streams running")
    for c in clients:
        c.join(10)
    assert code == 0, s.log()[-3000:]
    assert left == [], left
    assert len(ends) == 4 and all(status in (0, 200) for status, _ in ends), ends
    assert all(last == "data: [DONE]" for status, last in ends if status == 200), ends
    assert "is unreachable" not in s.log(), s.log()[-3000:]


def test_a_second_sigterm_while_ray_shuts_down_changes_nothing(stories_dir, tmp_path):
    s, temp_dir = _ray_server(stories_dir, tmp_path)
    pids: set[int] = set()
    try:
        pids = _ready_pids(s, temp_dir)
    finally:
        t0 = time.monotonic()
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while "stopping the Ray engine actors" not in s.log() and s.proc.poll() is None:
                assert time.monotonic() < deadline, s.log()[-3000:]
                time.sleep(0.02)  # NOTE: the drain is quick when idle; Ray's shutdown then takes seconds
            if s.proc.poll() is None:
                s.proc.send_signal(signal.SIGTERM)
        code, left, _ = _exit_code(s, pids, temp_dir, t0, "two SIGTERMs")
    assert code == 0, s.log()[-3000:]
    assert left == [], left
    assert "SIGTERM while the Ray engine actors stop" in s.log(), s.log()[-3000:]


def test_sigterm_while_ray_starts_exits_cleanly(stories_dir, tmp_path):
    s, temp_dir = _ray_server(stories_dir, tmp_path)
    pids: set[int] = set()
    try:
        server = psutil.Process(s.proc.pid)
        deadline = time.monotonic() + 120
        while s.proc.poll() is None and time.monotonic() < deadline:  # the GCS is up: ray.init runs
            if any(c.name() == "gcs_server" for c in server.children(recursive=True)):
                break
            time.sleep(0.02)
        pids = cluster_pids(server, temp_dir)
    finally:
        t0 = time.monotonic()
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
        code, left, took = _exit_code(s, pids, temp_dir, t0, "SIGTERM while Ray starts")
    assert code == 0, s.log()[-3000:]
    assert left == [], left
    assert took < 30, s.log()[-3000:]
    assert "SIGTERM while Ray starts: the server stops once ray.init has returned" in s.log(), s.log()[-3000:]
