"""Queue limit (429), engine-core death (503 for everyone, promptly), and SIGTERM drain (exit 0)."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time

import httpx
import pytest
from live_server import Server, metric_samples

QUEUE_FULL = {"error": {"message": "the waiting queue is full (1 requests); retry later",
                        "type": "rate_limit_error", "param": None, "code": "queue_full"}}
DEAD = {"error": {"message": "the engine core process died", "type": "service_unavailable", "param": None,
                  "code": "engine_unavailable"}}
LONG = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory):
    """One running sequence at a time and one waiting slot: the third concurrent request gets 429."""
    s = Server(stories_dir, tmp_path_factory.mktemp("small") / "server.log", "--max-num-seqs", "1",
               "--max-queue-len", "1")
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def completion(server, body, timeout=60.0):
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=timeout)


def stream(server, body) -> list[str]:
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        return sse_data_from(r.iter_lines())


def test_queue_full_is_429(server):
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda _: completion(server, LONG), range(6)))
    statuses = sorted(r.status_code for r in responses)
    assert 200 in statuses and 429 in statuses and set(statuses) == {200, 429}
    for r in responses:
        if r.status_code == 429:
            assert r.json() == QUEUE_FULL
        else:
            assert r.json()["usage"]["completion_tokens"] == 400


def test_core_death_turns_everything_503(server):
    # NOTE: runs last in this module: it kills the engine core of the shared server.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(stream, server, {**LONG, "max_tokens": 480, "stream": True})
        deadline = time.monotonic() + 10
        while metric_samples(server.url)[("tandem:num_requests_running", ())] < 1:
            assert time.monotonic() < deadline, "the request never started running"
            time.sleep(0.02)
        waiting = pool.submit(completion, server, {**LONG, "max_tokens": 480})  # queued behind it
        while metric_samples(server.url)[("tandem:num_requests_waiting", ())] < 1:
            assert time.monotonic() < deadline, "the second request was never queued"
            time.sleep(0.01)
        server.core_process().kill()
        t0 = time.monotonic()
        r = waiting.result(timeout=10)
        events = running.result(timeout=10)
    assert time.monotonic() - t0 < 5
    assert r.status_code == 503 and r.json() == DEAD
    # The stream had sent its 200 header: it ends with an error event, then [DONE].
    assert events[-1] == "[DONE]" and json.loads(events[-2]) == DEAD
    health = httpx.get(f"{server.url}/health", timeout=5)
    assert health.status_code == 503 and health.json() == DEAD
    r = completion(server, {"prompt": "Hi", "max_tokens": 2}, timeout=5)
    assert r.status_code == 503 and r.json() == DEAD
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=5,
                   json={"messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code in (400, 503)  # no chat template on this server: 400 may come first


def test_sigterm_drains_in_flight_and_exits_0(stories_dir, tmp_path):
    s = Server(stories_dir, tmp_path / "server.log", "--shutdown-timeout", "20")
    try:
        s.wait_healthy()
        body = {**LONG, "max_tokens": 300, "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            s.proc.send_signal(signal.SIGTERM)
            rest = sse_data_from(lines)
        chunks = [json.loads(first[6:])] + [json.loads(d) for d in rest[:-1]]
        assert rest[-1] == "[DONE]"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert s.proc.wait(30) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{s.url}/health", timeout=2)
        assert "Traceback" not in s.log()
    finally:
        s.stop()


def sse_data_from(lines) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]

