"""`tandem serve -dp 2 --data-parallel-backend ray` that starts its own local Ray cluster (no address) and gets
SIGTERM on its whole process group, as systemd's default `KillMode=control-group` sends it: the raylet (a
child in the group) exits too, and the server used to hang for good in `remove_placement_group` with its GCS
and engine actors alive. It must exit with code 0 and leave none of the cluster's processes running.

The cluster's temp dir is this test's own (`RAY_TMPDIR`), so the server starts a new cluster instead of joining
one another test left, and only this cluster's processes are looked at."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
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


def test_sigterm_to_the_process_group_of_a_local_ray_server_exits_cleanly(stories_dir, tmp_path):
    temp_dir = tempfile.mkdtemp(prefix="tl-", dir="/tmp")  # NOTE: short: Ray's socket paths have a length limit
    if os.environ.get("RAY_ADDRESS"):
        pytest.skip("RAY_ADDRESS is set: the server would join that cluster instead of starting its own")
    s = Server(stories_dir, tmp_path / "server.log", "-dp", "2", "--data-parallel-backend", "ray",
               "--served-model-name", MODEL, env={"RAY_TMPDIR": temp_dir}, new_session=True)
    pids: set[int] = set()
    try:
        s.wait_healthy(timeout_s=300)
        r = httpx.post(f"{s.url}/v1/completions", json=BODY, timeout=60)
        assert r.status_code == 200, r.text
        actors = {e["pid"] for e in httpx.get(f"{s.url}/load", timeout=10).json()["engines"]}
        pids = cluster_pids(psutil.Process(s.proc.pid), temp_dir) | actors
        names = {p.name() for p in running(pids)}
        assert {"gcs_server", "raylet"} <= names, names
        assert len(actors) == 2 and not actors & {s.proc.pid}
        t0 = time.monotonic()
        os.killpg(s.proc.pid, signal.SIGTERM)  # the server leads its group (new_session)
        try:
            code = s.proc.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server still runs 60 s after SIGTERM to its process group:\n{s.log()[-3000:]}")
        took = time.monotonic() - t0
        print(f"exited {took:.1f} s after SIGTERM to its process group")
        deadline = time.monotonic() + 10
        while running(pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [(p.pid, p.name()) for p in running(pids)]
    finally:
        if s.proc.poll() is None:
            os.killpg(s.proc.pid, signal.SIGKILL)
        s.stop()
        for p in running(pids):
            p.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert code == 0, s.log()[-3000:]
    assert left == [], left
    assert "stopping its processes and the engine actors without Ray calls" in s.log()
