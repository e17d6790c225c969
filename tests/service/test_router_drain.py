"""`tandem router` in front of one `tandem serve` that shuts down gracefully (SIGTERM): the backend stops
listening, so the router's probe is refused and ejects it, but the requests it had accepted must still get
its answers through the router (8 of 12 got 503 before: the ejection cut them short with nowhere to retry).
Also: `tandem router` and `tandem gateway` exit with code 0 on SIGTERM and on SIGINT (143 and a traceback
before)."""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import sys
import time

import httpx
import pytest
from live_server import MODEL, ROOT, RouterProcess, Server, free_port

BODY = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
N = 6


def _state(router: RouterProcess) -> str:
    return httpx.get(f"{router.url}/backends", timeout=5).json()["backends"][0]["state"]


def test_requests_a_draining_backend_accepted_complete_through_the_router(stories_dir, tmp_path):
    backend = Server(stories_dir, tmp_path / "backend.log", "--served-model-name", MODEL, "--max-num-seqs", "1",
                     "--shutdown-timeout", "60")
    router = RouterProcess([backend.url], tmp_path / "router.log", "--policy", "round-robin",
                           "--health-interval", "0.2", "--eject-seconds", "1")
    try:
        backend.wait_healthy(300.0)
        router.wait_healthy(120.0)
        with concurrent.futures.ThreadPoolExecutor(N) as pool:
            futures = [pool.submit(httpx.post, f"{router.url}/v1/completions", json=BODY, timeout=120)
                       for _ in range(N)]
            deadline = time.monotonic() + 60
            while httpx.get(f"{backend.url}/load", timeout=5).json()["waiting"] < N - 2:
                assert time.monotonic() < deadline, backend.log()[-2000:]
                time.sleep(0.02)  # NOTE: one runs at a time (--max-num-seqs 1): the others wait in its queue
            backend.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while _state(router) != "ejected":  # the drain refuses new connections: the probe fails
                assert time.monotonic() < deadline and not all(f.done() for f in futures), router.log()[-2000:]
                time.sleep(0.05)
            late = httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=30)
            answers = [f.result() for f in futures]
        assert late.status_code == 503 and "retry-after" in late.headers, late.text
        assert [r.status_code for r in answers] == [200] * N, [r.text[:200] for r in answers]
        assert [r.json()["usage"]["completion_tokens"] for r in answers] == [200] * N
        assert len({r.json()["choices"][0]["text"] for r in answers}) == 1  # greedy: the same story each time
        assert backend.proc.wait(60) == 0, backend.log()[-2000:]
    finally:
        backend.stop()
        code = router.stop()
    assert code == 0, router.log()[-2000:]  # SIGTERM (RouterProcess.stop)
    assert "Traceback" not in router.log()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("command", ["router", "gateway"])
def test_router_and_gateway_exit_0_on_a_signal(command, sig, tmp_path):
    """uvicorn raises the signal again after its graceful shutdown: with the default handlers that was exit 143
    (SIGTERM) or a KeyboardInterrupt traceback (SIGINT)."""
    port = free_port()
    flags = (["router", "--backend", "http://127.0.0.1:9", "--policy", "round-robin"] if command == "router" else
             ["gateway", "--primary", "http://127.0.0.1:9"])
    log_path = tmp_path / f"{command}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", *flags, "--port", str(port)], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while not _listening(port):  # NOTE: the router's /health is 503 here (no backend answers)
                assert time.monotonic() < deadline and proc.poll() is None, log_path.read_text()[-2000:]
                time.sleep(0.05)
            proc.send_signal(sig)
            code = proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert code == 0, log_path.read_text()[-2000:]
    assert "Traceback" not in log_path.read_text()


def _listening(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0)
    except httpx.HTTPError:
        return False
    return True
