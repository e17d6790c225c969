"""`tandem serve -dp 2` (stories260K, two engine cores on one core each): the greedy tokens of one
engine for 32 concurrent requests, same-prefix requests kept on one engine (the prefix hit rate of a
single engine), per-engine /load and /metrics, and a killed engine core: the other serves meanwhile,
the dead one is restarted and counted under its engine label; requests in flight on a killed core that
had sent nothing are re-dispatched to the other."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time

import httpx
import psutil
import pytest
from live_server import AUTH, MODEL, Server, metric_samples

PROMPTS = [f"Once upon a time there was a {w} who" for w in (
    "girl", "boy", "dog", "cat", "bird", "fish", "king", "queen", "frog", "bear", "duck", "mouse", "tree", "car",
    "ball", "boat", "lion", "tiger", "horse", "cow", "pig", "sheep", "goat", "owl", "bee", "ant", "fox", "wolf",
    "deer", "rabbit", "snake", "whale")]
PREFIXES = [" ".join(f"{w}{i}" for i in range(40)) for w in ("sun", "moon", "star", "rain")]  # ~5+ blocks each


@pytest.fixture(scope="module")
def dp_server(stories_dir, chat_template_file, tmp_path_factory):
    s = Server(stories_dir, tmp_path_factory.mktemp("dp") / "server.log", "-dp", "2", "--instance-id", "dp-test",
               "--served-model-name", MODEL, "--chat-template", str(chat_template_file))
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


async def _complete_all(url: str, bodies: list[dict], headers: dict | None = None) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=headers or {}) as client:
        responses = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
    failed = [r.text for r in responses if r.status_code != 200]
    assert not failed, failed
    return [r.json() for r in responses]


def _by_engine(url: str, name: str) -> dict[str, float]:
    return {dict(labels).get("engine", ""): v for (n, labels), v in metric_samples(url).items() if n == name}


def _aborted(url: str) -> float:
    return sum(v for (n, labels), v in metric_samples(url).items()
               if n == "tandem:request_success_total" and ("finished_reason", "abort") in labels)


def _hit_rate_delta(url: str, before: dict) -> float:
    after = metric_samples(url)

    def total(name: str, samples: dict) -> float:
        return sum(v for (n, _), v in samples.items() if n == name)

    hits = total("tandem:prefix_cache_hits_total", after) - total("tandem:prefix_cache_hits_total", before)
    queries = total("tandem:prefix_cache_queries_total", after) - total("tandem:prefix_cache_queries_total", before)
    return hits / queries


def test_dp2_gives_the_greedy_tokens_of_one_engine_for_32_concurrent_requests(dp_server, api_server):
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True} for p in PROMPTS]
    dp, single = asyncio.run(_complete_all(dp_server.url, bodies)), asyncio.run(
        _complete_all(api_server.url, bodies, AUTH))
    assert [c["choices"][0]["text"] for c in dp] == [c["choices"][0]["text"] for c in single]
    assert all(c["usage"]["completion_tokens"] == 12 for c in dp)
    load = httpx.get(f"{dp_server.url}/load", timeout=5).json()
    assert load["data_parallel_size"] == 2 and [e["engine"] for e in load["engines"]] == [0, 1]
    assert all(e["healthy"] and e["outstanding_requests"] == 0 and e["block_size"] == 16 for e in load["engines"])
    success = {k: v for k, v in metric_samples(dp_server.url).items()
               if k[0] == "tandem:request_success_total" and ("finished_reason", "length") in k[1]}
    assert sum(success.values()) >= 32 and all(v > 0 for v in success.values())  # both engines served


def test_same_prefix_requests_stay_on_one_engine(dp_server, api_server):
    """Four shared prefixes, four questions each, sent in two concurrent waves: the kv-aware hit rate
    of two engines is within 0.1 of one engine's (round-robin would split each prefix in two)."""
    waves = [[{"model": MODEL, "prompt": f"{p} question {q}:", "max_tokens": 2, "temperature": 0}
              for p in PREFIXES for q in qs] for qs in ((0,), (1, 2, 3))]
    rates = []
    for url, headers in ((dp_server.url, None), (api_server.url, AUTH)):
        before = metric_samples(url)
        for wave in waves:
            asyncio.run(_complete_all(url, wave, headers))
        rates.append(_hit_rate_delta(url, before))
    dp_rate, single_rate = rates
    print(f"prefix cache hit rate: -dp 2 kv-aware {dp_rate:.3f}, one engine {single_rate:.3f}")
    assert single_rate > 0.5
    assert dp_rate >= single_rate - 0.1, (dp_rate, single_rate)


def test_chat_completions_work_with_dp2(dp_server, api_server):
    """The chat endpoint renders through the data-parallel engine (it once got a 500: a missing argument)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 8,
            "temperature": 0}
    dp = httpx.post(f"{dp_server.url}/v1/chat/completions", json=body, timeout=120)
    single = httpx.post(f"{api_server.url}/v1/chat/completions", json=body, timeout=120,
                        headers=AUTH)
    assert dp.status_code == 200, dp.text
    assert dp.json()["choices"][0]["message"]["content"] == single.json()["choices"][0]["message"]["content"]


def test_a_closed_stream_is_aborted_on_the_engine_that_runs_it(dp_server):
    """The core that ran the stream stops computing it: the tokens computed by all engines stay far
    below its 500 requested ones, and both engines end idle with an empty KV cache."""

    def computed() -> float:
        return sum(v for (n, _), v in metric_samples(dp_server.url).items() if n == "tandem:iteration_tokens_total_sum")

    before, aborted_before = computed(), _aborted(dp_server.url)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{dp_server.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 20
    while True:
        engines = httpx.get(f"{dp_server.url}/load", timeout=5).json()["engines"]
        if all(e["running"] == 0 and e["kv_cache_usage"] == 0 for e in engines) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert all(e["running"] == 0 and e["kv_cache_usage"] == 0 and e["outstanding_requests"] == 0 for e in engines)
    assert computed() - before < 300
    assert _aborted(dp_server.url) - aborted_before == 1


def test_a_killed_engine_core_is_restarted_while_the_other_serves(dp_server):
    engines = httpx.get(f"{dp_server.url}/load", timeout=5).json()["engines"]
    victim = psutil.Process(engines[1]["pid"])
    victim.kill()
    t0 = time.monotonic()
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    statuses = []
    restarted = None
    while time.monotonic() - t0 < 240:  # NOTE: a restart is a fresh process importing torch: slow on a loaded machine
        statuses.append(httpx.post(f"{dp_server.url}/v1/completions", json=body, timeout=30).status_code)
        engines = httpx.get(f"{dp_server.url}/load", timeout=5).json()["engines"]
        if engines[1]["restarts"] == 1 and engines[1]["healthy"]:
            restarted = time.monotonic() - t0
            break
    assert restarted is not None, httpx.get(f"{dp_server.url}/load", timeout=5).text
    assert set(statuses) == {200}  # engine 0 answered while engine 1 was down
    assert engines[1]["pid"] != victim.pid and engines[0]["restarts"] == 0
    assert _by_engine(dp_server.url, "tandem:engine_core_restarts_total") == {"0": 0.0, "1": 1.0}
    print(f"engine core 1 restarted {restarted:.2f} s after the kill")
    final = httpx.post(f"{dp_server.url}/v1/completions", json=body, timeout=30)
    assert final.status_code == 200


# NOTE: 111 tokens (6 full blocks) shared by three prompts of 117 tokens: 6 of their 7 blocks match, so
# kv-aware sends them to the engine that holds the prefix whatever its load (6/7 - beta 0.5 > 0).
HILL = " ".join(f"hill{i}" for i in range(24))
HILL_PROMPTS = [f"{HILL} story {k}:" for k in range(3)]
DIED = {"error": {"message": "the engine core process died", "type": "service_unavailable", "param": None,
                  "code": "engine_unavailable"}}


def _hill(k: int, stream: bool = False) -> dict:
    return {"model": MODEL, "prompt": HILL_PROMPTS[k], "max_tokens": 380, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def _events(url: str, body: dict, first: threading.Event | None = None) -> list:
    """A stream's data events (JSON, then "[DONE]"); sets ``first`` once the first one arrived."""
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                if first is not None:
                    first.set()
    return events


def _engines(url: str) -> list[dict]:
    return httpx.get(f"{url}/load", timeout=5).json()["engines"]


def _wait_for(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _by_reason(url: str, reason: str) -> dict[str, float]:
    return {dict(labels)["engine"]: v for (n, labels), v in metric_samples(url).items()
            if n == "tandem:request_success_total" and ("finished_reason", reason) in labels}


def _prefix_onto_engine_1(url: str, pool) -> str:
    """Puts HILL's blocks into engine 1's cache (engine 0, frozen, holds an accepted-pending request, so
    the first HILL prompt goes to the less loaded engine 1); returns that prompt's greedy text."""
    core0 = psutil.Process(_engines(url)[0]["pid"])
    core0.suspend()
    try:
        held = pool.submit(_post, url, {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8})
        _wait_for(lambda: _engines(url)[0]["outstanding_requests"] == 1, "the held request never reached engine 0")
        first = _post(url, _hill(0))
    finally:
        core0.resume()
    assert first.status_code == 200 and held.result(timeout=60).status_code == 200
    return first.json()["choices"][0]["text"]


def _settle(url: str) -> None:
    """Waits until the front end has read what the frozen engine 1 sent: its generated-token count stays
    the same over three reads 0.1 s apart."""
    counts: list[float] = []
    while len(counts) < 3 or len(set(counts[-3:])) > 1:
        counts.append(metric_samples(url)[("tandem:generation_tokens_total", (("engine", "1"),))])
        time.sleep(0.1)


def _frozen_with_three_running(url: str, pool, core1: psutil.Process) -> tuple:
    """Two non-streamed HILL requests and a stream that got its first chunk, running on engine 1, which is
    then frozen (SIGSTOP) with the three still in flight (retried when they finished first: stories260K's
    380 tokens take well under a second). Returns (the two response futures, the stream's future)."""
    for _attempt in range(5):
        first = threading.Event()
        chunked = pool.submit(_events, url, _hill(0, stream=True), first)
        plain = [pool.submit(_post, url, _hill(k)) for k in (1, 2)]
        _wait_for(lambda first=first: first.is_set() and _engines(url)[1]["running"] == 3,
                  "the three never ran on engine 1")
        core1.suspend()
        _settle(url)
        if _engines(url)[1]["outstanding_requests"] == 3:
            return plain, chunked
        core1.resume()
        for f in (*plain, chunked):
            f.result(timeout=60)
    raise AssertionError("the requests finished before engine 1 could be frozen in five attempts")


def _text(events: list) -> str:
    return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and "choices" in e)


def test_requests_in_flight_on_a_killed_engine_core_are_redispatched_before_their_first_byte(dp_server):
    """Engine 1 holds the HILL prefix, runs two non-streamed requests and a stream that sent a chunk, and
    (frozen) has two more non-streamed requests and two streams waiting to be accepted; then it is killed.
    Every request that had sent nothing gets 200 with the greedy text, from engine 0; the stream that had
    sent a chunk ends with the 503 error event; the re-dispatches are counted under engine 1, and the
    router's counters and the gauges end at 0."""
    url = dp_server.url
    _wait_for(lambda: all(e["healthy"] for e in _engines(url)), "an engine core is not serving", 240)
    before = {"moved": _by_engine(url, "tandem:request_redispatches_total"), "aborts": _by_reason(url, "abort"),
              "done": _by_reason(url, "length")}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        reference = [_prefix_onto_engine_1(url, pool)]
        reference += [_post(url, _hill(k)).json()["choices"][0]["text"] for k in (1, 2)]
        assert _by_reason(url, "length")["1"] - before["done"]["1"] == 3  # the prefix drew the three to engine 1
        core1 = psutil.Process(_engines(url)[1]["pid"])
        running, chunked = _frozen_with_three_running(url, pool, core1)
        waiting = [pool.submit(_post, url, _hill(k)) for k in (0, 1)]
        waiting_streams = [pool.submit(_events, url, _hill(k, stream=True)) for k in (1, 2)]
        _wait_for(lambda: _engines(url)[1]["outstanding_requests"] == 7, "the four never reached engine 1")
        core1.kill()
        plain = [(k, f.result(timeout=60)) for k, f in zip((1, 2, 0, 1), running + waiting, strict=True)]
        streams = [(k, f.result(timeout=60)) for k, f in zip((1, 2), waiting_streams, strict=True)]
        cut = chunked.result(timeout=60)
    assert [r.status_code for _, r in plain] == [200] * 4, [r.text for _, r in plain]
    assert [r.json()["choices"][0]["text"] for _, r in plain] == [reference[k] for k, _ in plain]
    assert [(e[-1], e[-2]["choices"][0]["finish_reason"], _text(e)) for _, e in streams] == [
        ("[DONE]", "length", reference[k]) for k, _ in streams]
    assert cut[-2:] == [DIED, "[DONE]"] and reference[0].startswith(_text(cut))
    moved = _by_engine(url, "tandem:request_redispatches_total")
    aborts = _by_reason(url, "abort")
    assert aborts["1"] - before["aborts"]["1"] == 7  # every request in flight on engine 1 ended there
    assert {r: moved[r] - before["moved"].get(r, 0.0) for r in moved} == {"0": 0.0, "1": 6.0}  # all but the cut stream
    _wait_for(lambda: all(e["outstanding_requests"] == 0 and e["outstanding_tokens"] == 0 and e["running"] == 0
                          and e["kv_cache_usage"] == 0 for e in _engines(url)), "work was left on an engine")
    m = metric_samples(url)
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert [m[(f"tandem:{gauge}", (("engine", r),))] for r in ("0", "1")] == [0, 0], gauge
