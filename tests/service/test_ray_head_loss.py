"""`tandem serve -dp 2 --data-parallel-backend ray` whose Ray head goes away: a head made here with
`ray start --head` (its own `--temp-dir`, so only its processes are touched) is killed under the server.
Ray would end the server's process once its GCS has been unreachable for
`RAY_gcs_rpc_server_reconnect_timeout_s` (20 s here instead of 60, to keep the test short; the server
leaves the cluster after a third of it, and `ray.shutdown` takes about 5 s). The server must instead stay
up, log one ERROR naming the cluster and answer 503 `engine_unavailable` on `/health` and on requests;
once a head is started again at the same address it joins it, starts new engine actors and serves again;
and it still shuts down cleanly (exit code 0) on SIGTERM."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import httpx
import psutil
import pytest
from live_server import MODEL, ROOT, Server, free_port

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'tandem[ray]'); the Ray backend is untested")

BODY = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
RAY_GCS_TIMEOUT_S = 20  # Ray ends a driver whose GCS is unreachable this long (default 60)
# NOTE: a head of Ray 2.60 turns on token authentication by default; this one runs without.
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_gcs_rpc_server_reconnect_timeout_s": str(RAY_GCS_TIMEOUT_S)}


def head_processes(temp_dir: str) -> list[psutil.Process]:
    """The head's processes: those naming ``temp_dir`` (GCS, raylet, monitors) and the raylet's children."""
    found = {p.pid: p for p in psutil.process_iter(["cmdline"]) if temp_dir in " ".join(p.info["cmdline"] or [])}
    for p in list(found.values()):
        try:
            found.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
    return list(found.values())


def start_head(port: int, temp_dir: str) -> None:
    started = subprocess.run(["ray", "start", "--head", "--num-cpus", "2", "--include-dashboard=false",
                              "--port", str(port), "--temp-dir", temp_dir, "--disable-usage-stats"],
                             env={**os.environ, **RAY_ENV}, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stdout + started.stderr


@pytest.fixture
def ray_head():
    """A Ray head of 2 CPUs on a free port; yields its address, temp dir and a function that starts it
    again; kills whatever of it is left."""
    if shutil.which("ray") is None:
        pytest.skip("the `ray` command is not on PATH")
    temp_dir = tempfile.mkdtemp(prefix="tr-", dir="/tmp")  # NOTE: short: Ray's socket paths have a length limit
    port = free_port()
    procs: list[psutil.Process] = []

    def start() -> None:
        start_head(port, temp_dir)
        procs.extend(head_processes(temp_dir))

    try:
        start()
        yield f"127.0.0.1:{port}", temp_dir, start
    finally:
        for p in procs + head_processes(temp_dir):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_server_outlives_its_ray_head_answers_503_and_serves_again_once_it_is_back(ray_head, stories_dir, tmp_path):
    address, temp_dir, start_again = ray_head
    s = Server(stories_dir, tmp_path / "server.log", "-dp", "2", "--data-parallel-backend", "ray",
               "--ray-address", address, "--served-model-name", MODEL, env=RAY_ENV)
    try:
        s.wait_healthy(timeout_s=300)
        r = httpx.post(f"{s.url}/v1/completions", json=BODY, timeout=60)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        head = head_processes(temp_dir)
        assert {p.name() for p in head} >= {"gcs_server", "raylet"}
        for p in head:
            p.kill()
        t0 = time.monotonic()
        early = httpx.post(f"{s.url}/v1/completions", json=BODY, timeout=30)  # NOTE: a lost connection, not 429
        # Past Ray's own timeout (which ended the server before) and the server's check (a third of it).
        while time.monotonic() - t0 < RAY_GCS_TIMEOUT_S + 3:
            assert s.proc.poll() is None, f"the server exited with {s.proc.returncode}:\n{s.log()[-3000:]}"
            time.sleep(0.5)
        health = httpx.get(f"{s.url}/health", timeout=10)
        r = httpx.post(f"{s.url}/v1/completions", json=BODY, timeout=10)
        lines = [line for line in s.log().splitlines() if "ERROR tandem.engine.ray_cluster" in line]
        errors = [line for line in s.log().splitlines() if " ERROR " in line]
        assert s.proc.poll() is None
        start_again()
        t0 = time.monotonic()
        while httpx.get(f"{s.url}/health", timeout=10).status_code != 200:
            assert time.monotonic() - t0 < 180, s.log()[-3000:]
            time.sleep(0.5)
        print(f"serving again {time.monotonic() - t0:.1f} s after the head was started again")
        again = httpx.post(f"{s.url}/v1/completions", json=BODY, timeout=60)
        engines = httpx.get(f"{s.url}/load", timeout=10).json()["engines"]
        rejoined = [line for line in s.log().splitlines() if "rejoined the Ray cluster at" in line]
    finally:
        code = s.stop()
    assert early.status_code == 503 and early.json()["error"]["code"] == "engine_unavailable", early.text
    assert health.status_code == 503
    assert health.json()["error"]["code"] == "engine_unavailable"
    assert r.status_code == 503
    error = r.json()["error"]
    assert error["code"] == "engine_unavailable" and error["type"] == "service_unavailable"
    port = address.rpartition(":")[2]  # NOTE: the message names the GCS's address (the node's IP, same port)
    assert f":{port} is unreachable" in error["message"]
    assert error["message"].endswith("its engine actors are lost; the server answers 503 until the cluster is back "
                                     "(it then starts the engine actors again)")
    assert r.headers["Retry-After"] == "10"
    assert len(lines) == 1 and "the Ray cluster at" in lines[0] and "engine actors are lost" in lines[0], lines
    assert errors == lines  # NOTE: the engines' lost connections are WARNINGs (the GCS did not answer either)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == text
    assert len(rejoined) == 1 and [e["restarts"] for e in engines] == [1, 1] and all(e["healthy"] for e in engines)
    assert code == 0, s.log()[-3000:]


def test_an_orphaned_server_leaves_its_lost_cluster_alive(ray_head, stories_dir, tmp_path):
    """A server whose parent is pid 1 (under systemd or tini, or started with `&` from a shell that exited): Ray's
    core worker took its raylet for dead once the head was gone, and leaving the cluster (ray.shutdown) ended the
    process without a word. It must stay up and answer 503 like any other."""
    address, temp_dir, _ = ray_head
    port, log = free_port(), tmp_path / "server.log"
    cmd = [sys.executable, "-m", "tandem.cli", "--log-level", "INFO", "serve", "--model", str(stories_dir),
           "--dtype", "float32", "--num-threads", "1", "--port", str(port), "-dp", "2",
           "--data-parallel-backend", "ray", "--ray-address", address, "--served-model-name", MODEL]
    # NOTE: the shell starts the server in the background and exits: the server is re-parented (to pid 1 here)
    started = subprocess.run(["sh", "-c", f'{shlex.join(cmd)} >{shlex.quote(str(log))} 2>&1 & echo $!'],
                             cwd=ROOT, env={**os.environ, **RAY_ENV}, capture_output=True, text=True, timeout=30)
    server = psutil.Process(int(started.stdout.strip()))
    url = f"http://127.0.0.1:{port}"
    try:
        if server.ppid() != 1:
            pytest.skip(f"the orphaned server's parent is pid {server.ppid()} (a subreaper), not 1")
        deadline = time.monotonic() + 300
        while not _healthy(url):
            assert server.is_running() and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        for p in head_processes(temp_dir):
            p.kill()
        t0 = time.monotonic()
        while time.monotonic() - t0 < RAY_GCS_TIMEOUT_S + 3:
            assert server.is_running() and server.status() != psutil.STATUS_ZOMBIE, \
                f"the server vanished:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        health = httpx.get(f"{url}/health", timeout=10)
    finally:
        if server.is_running():
            server.terminate()
            try:
                server.wait(30)
            except psutil.TimeoutExpired:
                server.kill()
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_unavailable"
    lines = [line for line in log.read_text().splitlines() if " ERROR " in line]
    assert len(lines) == 1 and "ERROR tandem.engine.ray_cluster" in lines[0] and "engine actors are lost" in lines[0], \
        lines


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False
