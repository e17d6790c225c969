"""`tandem engine` (one engine core as a network service) behind `tandem serve --engine-address`:
the same greedy output as a server with its own core, a wrong secret refused (and counted), the core
killed mid-stream (an SSE error event and [DONE], then 503 with Retry-After) and restarted on the same
port (the server reconnects and serves again)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest
from live_server import AUTH, MODEL, ROOT, EngineService, Server

SECRET = "remote-engine-test-secret"
GREEDY = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
LONG = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("secret") / "engine.secret"
    path.write_text(SECRET + "\n")
    return path


@pytest.fixture(scope="module")
def engine(stories_dir, secret_file, tmp_path_factory):
    e = EngineService(stories_dir, tmp_path_factory.mktemp("engine") / "engine.log", None,
                      "--engine-secret-file", str(secret_file))
    try:
        e.wait_listening()
        yield e
    finally:
        e.stop()


@pytest.fixture(scope="module")
def remote_server(stories_dir, engine, secret_file, tmp_path_factory):
    s = Server(stories_dir, tmp_path_factory.mktemp("remote") / "server.log", "--engine-address", engine.address,
               "--engine-secret-file", str(secret_file))
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def test_remote_core_gives_the_local_cores_greedy_output(remote_server, api_server):
    remote = httpx.post(f"{remote_server.url}/v1/completions", json=GREEDY, timeout=30)
    local = httpx.post(f"{api_server.url}/v1/completions", json={**GREEDY, "model": MODEL}, headers=AUTH, timeout=30)
    assert remote.status_code == 200 and local.status_code == 200
    assert remote.json()["choices"][0]["text"] == local.json()["choices"][0]["text"]
    assert remote.json()["usage"] == {"prompt_tokens": 5, "completion_tokens": 24, "total_tokens": 29,
                                      "prompt_tokens_details": {"cached_tokens": 0}}
    assert "core at tcp://127.0.0.1:" in remote_server.log()


def test_a_wrong_secret_is_refused_logged_and_counted(stories_dir, engine, tmp_path, remote_server):
    wrong = tmp_path / "wrong.secret"
    wrong.write_text("not-the-secret")
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--model", str(stories_dir), "--port", "0",
           "--engine-address", engine.address, "--engine-secret-file", str(wrong)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"tandem: error: the engine core at {engine.address} refused this front end: wrong or missing engine secret")
    assert "refused a front end from 127.0.0.1: wrong or missing engine secret (" in engine.log()
    # the connected server was not disturbed
    assert httpx.post(f"{remote_server.url}/v1/completions", json=GREEDY, timeout=30).status_code == 200


def test_killed_engine_ends_the_stream_then_503_then_reconnects(remote_server, engine, stories_dir, secret_file):
    events: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", f"{remote_server.url}/v1/completions", json=LONG, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():  # NOTE: one by one, so the test sees the stream running
                if line.startswith("data: "):
                    events.append(line[len("data: "):])

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 20
    while len(events) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(events) >= 3 and events[-1] != "[DONE]"
    engine.proc.kill()
    engine.proc.wait()
    reader.join(20)
    lost = f"the connection to the engine core at {engine.address} was lost"
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2]) == {"error": {"message": lost, "type": "service_unavailable", "param": None,
                                                "code": "engine_unavailable"}}
    r = httpx.post(f"{remote_server.url}/v1/completions", json=GREEDY, timeout=10)
    assert r.status_code == 503 and r.headers["Retry-After"] == "2"
    assert r.json()["error"]["message"] == f"{lost}; reconnecting"
    assert httpx.get(f"{remote_server.url}/health", timeout=5).status_code == 503

    restarted = EngineService(stories_dir, engine.log_path, engine.port, "--engine-secret-file", str(secret_file))
    engine.proc = restarted.proc  # NOTE: the module fixture stops whichever engine runs last
    restarted.wait_listening()
    deadline = time.monotonic() + 30
    while (r := httpx.post(f"{remote_server.url}/v1/completions", json=GREEDY, timeout=10)).status_code != 200:
        assert r.status_code == 503 and time.monotonic() < deadline, r.text
        time.sleep(0.1)
    assert r.json()["usage"]["completion_tokens"] == 24
    assert "reconnected to the engine core after" in remote_server.log()


def test_engine_flags_with_an_engine_address_are_refused(stories_dir):
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--model", str(stories_dir), "--port", "0",
           "--engine-address", "tcp://127.0.0.1:9", "--dtype", "float32", "--kv-cache-gib", "1"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "tandem: error: --dtype, --kv-cache-gib configure the engine core, which runs elsewhere with "
        "--engine-address: pass them to `tandem engine` instead")
