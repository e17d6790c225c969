"""Engine-core supervision on a live server: killing the core mid-stream ends every open stream with
an error event and [DONE], the core is restarted and serves again within seconds (counted in
/metrics, logged), and a crash loop stops the restarts for good (503 from then on)."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest
from live_server import Server, metric_samples, sse_data

DIED = {"error": {"message": "the engine core process died", "type": "service_unavailable", "param": None,
                  "code": "engine_unavailable"}}
RESTARTING = {"error": {"message": "the engine core is restarting; retry shortly", "type": "service_unavailable",
                        "param": None, "code": "engine_unavailable"}}
LONG = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "temperature": 0, "stream": True}


def open_stream(server: Server) -> list[str]:
    with httpx.stream("POST", f"{server.url}/v1/completions", json=LONG, timeout=60) as r:
        assert r.status_code == 200
        return sse_data(r)


def wait_running(server: Server, count: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while metric_samples(server.url)[("tandem:num_requests_running", ())] < count:
        assert time.monotonic() < deadline, f"{count} requests never ran together"
        time.sleep(0.02)


def first_success_after(server: Server, t0: float, timeout_s: float = 60.0) -> tuple[float, list[int]]:
    """Seconds from ``t0`` until a completion succeeds, and the statuses seen before it."""
    statuses = []
    while time.monotonic() - t0 < timeout_s:
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
        if r.status_code == 200:
            return time.monotonic() - t0, statuses
        statuses.append(r.status_code)
        if r.status_code == 503 and r.json() == RESTARTING:
            assert r.headers["Retry-After"] == "2"
        time.sleep(0.05)
    raise AssertionError(f"no success within {timeout_s} s; statuses {statuses[-5:]}")


@pytest.fixture(scope="module")
def servers(stories_dir, tmp_path_factory, server_pool):
    """Both servers of the module, started together when neither runs yet: the supervised one (4 running,
    restart limit 2 in 600 s: the "busy" server of conftest.py, after test_load.py; retired at the end, its core
    is gone) and a plain one whose front end the last test kills."""
    started = {"supervised": server_pool.start("busy"),
               "plain": Server(stories_dir, tmp_path_factory.mktemp("plain") / "server.log")}
    try:
        for s in started.values():
            s.wait_healthy(300.0)  # NOTE: two at once on a loaded 2-core machine
        yield started
    finally:
        server_pool.retire("busy")
        started["plain"].stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers["supervised"]


def test_killed_core_ends_open_streams_then_restarts(server):
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        streams = [pool.submit(open_stream, server) for _ in range(3)]
        wait_running(server, 3)
        old_pid = server.core_process().pid
        server.core_process().kill()
        t0 = time.monotonic()
        results = [f.result(timeout=20) for f in streams]
    for events in results:
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2]) == DIED
        assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-2])
    # NOTE: no speed bound here (restart times are measured in tests/service/restart_times.py): a restart
    # is a fresh process importing torch, 10 s quiet and 50 s at load 12; only that it comes back
    elapsed, statuses = first_success_after(server, t0, timeout_s=240.0)
    assert set(statuses) <= {503}
    print(f"the core served again {elapsed:.1f} s after the kill")
    assert server.core_process().pid != old_pid
    m = metric_samples(server.url)
    assert m[("tandem:engine_core_restarts_total", ())] == 1
    assert m[("tandem:request_success_total", (("finished_reason", "abort"),))] >= 3
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    assert "engine core restarted in" in server.log()


def test_crash_loop_stops_restarting_for_good(server):
    # --core-restart-limit 2: the first test's death was the first; this one is the second.
    server.core_process().kill()
    message = ("the engine core process died; it died 2 times within 600 s (crash loop), so it is not restarted")
    gone = {"error": {**DIED["error"], "message": message}}
    deadline = time.monotonic() + 10
    while True:
        r = httpx.get(f"{server.url}/health", timeout=5)
        if r.status_code == 503 and r.json() == gone or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert r.status_code == 503 and r.json() == gone
    assert "Retry-After" not in r.headers
    time.sleep(1.0)
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=5)
    assert r.status_code == 503 and r.json() == gone
    assert f"{message}: the server answers 503 until it is restarted" in server.log()
    assert metric_samples(server.url)[("tandem:engine_core_restarts_total", ())] == 1
    with pytest.raises(LookupError):
        server.core_process()


def test_a_killed_front_end_takes_its_fork_server_and_engine_core_with_it(servers):
    """``kill -9`` of ``tandem serve`` leaves no orphan: the fork server sees its front end gone and
    exits, the core, whose parent that was, leaves its loop, and the resource tracker follows (the
    fork server and core used to run on, 384 MB)."""
    import psutil

    s = servers["plain"]
    core = s.core_process()
    family = psutil.Process(s.proc.pid).children(recursive=True)  # fork server, core, resource tracker
    forkservers = [p for p in family if "forkserver" in " ".join(p.cmdline()) and p.pid != core.pid]
    assert len(forkservers) == 1 and core.ppid() == forkservers[0].pid and core in family
    s.proc.kill()
    s.proc.wait(timeout=10)
    _, alive = psutil.wait_procs(family, timeout=60)
    assert not alive, [(p.pid, p.cmdline()[:3]) for p in alive]
