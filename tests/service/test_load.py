"""Overload and load reporting on a live server with a small queue: 300 concurrent requests get
only 200 or 429 (with Retry-After), ``GET /load`` and the metrics' ``instance_id`` label, and a
client's ``request_id`` used twice at once is a 400."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from live_server import wait_idle

QUEUE_FULL = {"error": {"message": "the waiting queue is full (8 requests); retry later", "type": "rate_limit_error",
                        "param": None, "code": "queue_full"}}


@pytest.fixture(scope="module")
def server(server_pool):
    """Queue bound 8, 4 running, instance id ``test-instance``: the "busy" server of conftest.py, which
    test_supervision.py uses next (its restart flags change nothing here)."""
    s = server_pool.start("busy")
    s.wait_healthy(300.0)
    return s


def test_300_concurrent_requests_get_only_200_or_429(server):
    body = {"prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True, "temperature": 0}

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(300)))

    t0 = time.monotonic()
    responses = asyncio.run(run())
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {200, 429}, sorted(set(statuses))
    for r in responses:
        if r.status_code == 429:
            assert r.json() == QUEUE_FULL and r.headers["Retry-After"] == "1"
        else:
            assert r.json()["usage"]["completion_tokens"] == 8
    assert time.monotonic() - t0 < 100
    idle = wait_idle(server.url)
    assert idle[("tandem:kv_cache_usage_perc", ())] == 0
    assert json.loads(httpx.get(f"{server.url}/load", timeout=5).text)["waiting"] == 0


def test_load_reports_queue_kv_and_instance(server):
    wait_idle(server.url)
    load = httpx.get(f"{server.url}/load", timeout=5).json()
    assert load == {"instance_id": "test-instance", "running": 0, "waiting": 0, "kv_cache_usage": 0.0,
                    "block_size": 16, "num_kv_blocks": load["num_kv_blocks"], "max_queue_len": 8, "healthy": True,
                    "kv_events": None, "restarts": 0}
    assert load["num_kv_blocks"] > 0
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        next(line for line in lines if line.startswith("data: "))
        busy = httpx.get(f"{server.url}/load", timeout=5).json()
    assert busy["running"] == 1 and 0 < busy["kv_cache_usage"] <= 1
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    assert 'tandem:num_requests_running{instance_id="test-instance",model_name=' in text


def test_a_request_id_in_use_is_400(server):
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True, "request_id": "job-1"}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # NOTE: kept referenced: a closed line iterator closes the stream
        next(line for line in lines if line.startswith("data: "))
        again = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=10)
    assert again.status_code == 400
    assert again.json() == {"error": {"message": "request id 'job-1' is already in use",
                                      "type": "invalid_request_error", "param": "request_id",
                                      "code": "duplicate_request_id"}}
    wait_idle(server.url)
    done = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False, "max_tokens": 2}, timeout=10)
    assert done.status_code == 200 and done.json()["id"] == "cmpl-job-1"


def test_a_streamed_list_prompt_merges_every_choice(server):
    # Two prompts x n=2 through the bounded merge: each choice's deltas add up to the non-streamed text.
    body = {"prompt": ["Once upon a time", "Hi"], "n": 2, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
    texts = {c["index"]: c["text"] for c in whole["choices"]}
    assert sorted(texts) == [0, 1, 2, 3]
    streamed: dict[int, str] = {}
    finished = {}
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        for c in json.loads(event)["choices"]:
            streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
            if c["finish_reason"] is not None:
                finished[c["index"]] = c["finish_reason"]
    assert streamed == texts
    assert finished == {i: "length" for i in range(4)}
