"""`tandem router` in front of two `tandem serve` processes (stories260K), driven by the openai client."""

import os
import signal
import threading
import time

import httpx
import openai
import pytest
from live_server import MODEL, RouterProcess, Server, metric_samples

KV_EVENTS = ('{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*", '
             '"replay_endpoint": "tcp://127.0.0.1:*"}')
MESSAGES = [{"role": "system", "content": "You tell short stories."},
            {"role": "user", "content": "Once upon a time there was a little dog"}]


@pytest.fixture(scope="module")
def cluster(stories_dir, chat_template_file, tmp_path_factory):
    """Two backends (the second publishes KV events, the first does not) and a router capping each at
    one request in flight, probing every 0.2 s."""
    logs = tmp_path_factory.mktemp("router")
    flags = ("--chat-template", str(chat_template_file), "--served-model-name", MODEL)
    backends = [Server(stories_dir, logs / "backend0.log", *flags),
                Server(stories_dir, logs / "backend1.log", *flags, "--kv-events-config", KV_EVENTS)]
    # NOTE: the router starts with the backends; it finds them (and backend 1's KV events) when they answer
    router = RouterProcess([b.url for b in backends], logs / "router.log", "--tokenizer", str(stories_dir),
                           "--chat-template", str(chat_template_file), "--max-outstanding-per-backend", "1",
                           "--health-interval", "0.2", "--eject-seconds", "1")
    try:
        for b in backends:
            b.wait_healthy(300.0)  # NOTE: generous: three processes start at once on a loaded 2-core machine
        router.wait_healthy(300.0)
        deadline = time.monotonic() + 60
        while [b["state"] for b in httpx.get(f"{router.url}/backends").json()["backends"]] != ["healthy"] * 2:
            assert time.monotonic() < deadline, router.log()
            time.sleep(0.1)
        yield router, backends
    finally:
        for p in [router, *backends]:
            p.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60.0)


def _stream(url: str, **kw) -> list[tuple]:
    chunks = _client(url).chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, temperature=0.0,
                                                  stream_options={"include_usage": True}, **kw)
    return [(c.object, c.model, [(ch.index, ch.delta.role, ch.delta.content, ch.finish_reason) for ch in c.choices],
             # NOTE: the prefix-cache hit (prompt_tokens_details.cached_tokens) depends on what ran before
             c.usage.model_dump(exclude={"prompt_tokens_details"}) if c.usage else None) for c in chunks]


def test_streaming_passes_through_intact(cluster):
    router, backends = cluster
    assert "tandem router: listening on http://127.0.0.1:" in router.log()  # the ready line
    direct = _stream(backends[0].url, max_tokens=24)
    assert len(direct) > 3 and direct[-1][3]["completion_tokens"] == 24
    for _ in range(2):  # whichever backend the router picks, the chunks are the direct ones
        assert _stream(router.url, max_tokens=24) == direct
    r = httpx.get(f"{router.url}/v1/models", timeout=10.0)
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == [MODEL]


def test_kv_aware_routes_to_the_backend_whose_events_announced_the_prefix(cluster):
    router, backends = cluster
    messages = [{"role": "system", "content": "A story about a cat named Tom who liked the sun. " * 3},
                {"role": "user", "content": "Tell it."}]
    _client(backends[1].url).chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    deadline = time.monotonic() + 30
    while httpx.get(f"{router.url}/backends").json()["backends"][1]["kv_events"]["received"] == 0:
        assert time.monotonic() < deadline, "no KV event reached the router"
        time.sleep(0.1)
    before = metric_samples(router.url)
    out = _client(router.url).chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert out.usage.completion_tokens == 2
    after = metric_samples(router.url)
    key = ("tandem_router:requests_total", (("backend", backends[1].url),))
    assert after[key] - before[key] == 1  # idle backends tie on load: the events decided
    hits = ("tandem_router:routed_hit_blocks_total", (("backend", backends[1].url),))
    assert after[hits] - before[hits] >= 3  # the system prompt's full blocks
    info = httpx.get(f"{router.url}/backends").json()["backends"]
    assert [b["index"] for b in info] == ["approximate", "kv-events"] and info[1]["kv_events"]["snapshots"] >= 1


def test_429_with_retry_after_when_both_backends_are_full(cluster):
    router, _ = cluster
    client = _client(router.url)
    held = [client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, max_tokens=400,
                                           extra_body={"ignore_eos": True}) for _ in range(2)]
    try:
        for s in held:
            next(iter(s))  # both dispatched: each backend holds one request in flight
        t0 = time.monotonic()
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        assert time.monotonic() - t0 < 5.0
        assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "1"
        assert e.value.body["code"] == "all_backends_busy"
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 30
    while any(b["outstanding_requests"] for b in httpx.get(f"{router.url}/backends").json()["backends"]):
        assert time.monotonic() < deadline, "the closed streams were never completed at the router"
        time.sleep(0.05)


def _wait_backends(router, check, what: str, timeout_s: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while not check(info := httpx.get(f"{router.url}/backends", timeout=5.0).json()["backends"]):
        assert time.monotonic() < deadline, f"{what}: {info}\n{router.log()}"
        time.sleep(0.05)
    return info


def test_a_request_held_by_a_sigstopped_backend_completes_on_the_other_once_it_is_ejected(cluster):
    """SIGSTOP: the backend accepts connections and never answers. The router's /health probe times
    out (5 s) and ejects it; the request waiting there is retried at once on the other backend
    instead of waiting out --request-timeout (600 s; the client here gives up after 60 s)."""
    router, backends = cluster
    client = _client(router.url)
    held = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, max_tokens=400,
                                          extra_body={"ignore_eos": True})
    result: dict = {}
    stopped = None
    try:
        next(iter(held))  # dispatched: that backend is at its cap of one, the next request goes to the other
        info = _wait_backends(router, lambda i: sum(b["outstanding_requests"] for b in i) == 1, "held stream")
        live = backends[[b["outstanding_requests"] for b in info].index(1)]
        stopped = backends[1 - backends.index(live)]
        before = metric_samples(router.url)
        os.kill(stopped.proc.pid, signal.SIGSTOP)

        def ask() -> None:
            t0 = time.monotonic()
            try:
                out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0.0)
                result["tokens"] = out.usage.completion_tokens
            except Exception as e:  # noqa: BLE001 - reported by the asserts below
                result["error"] = repr(e)
            result["elapsed_s"] = time.monotonic() - t0

        asking = threading.Thread(target=ask)
        asking.start()
        _wait_backends(router, lambda i: i[backends.index(stopped)]["outstanding_requests"] == 1, "sent to it")
        held.close()
        _wait_backends(router, lambda i: i[backends.index(live)]["outstanding_requests"] == 0, "held closed")
        asking.join(60.0)
        assert result.get("tokens") == 4, (result, router.log())
        assert result["elapsed_s"] < 12.0  # the 5 s probe timeout, then the retry; not a 60 s client timeout
        after = metric_samples(router.url)
        delta = {k: after[k] - before.get(k, 0.0) for k in after if k[0].endswith("_total")}
        url = (("backend", stopped.url),)
        assert delta[("tandem_router:errors_total", (*url, ("kind", "ejected")))] == 1
        assert delta[("tandem_router:retries_total", ())] == 1
        assert delta[("tandem_router:ejections_total", url)] == 1
        assert delta[("tandem_router:requests_total", url)] == 1
        assert delta[("tandem_router:requests_total", (("backend", live.url),))] == 1
        assert delta[("tandem_router:errors_total", (*url, ("kind", "probe")))] >= 1
    finally:
        held.close()
        if stopped is not None:
            os.kill(stopped.proc.pid, signal.SIGCONT)
    _wait_backends(router, lambda i: [b["state"] for b in i] == ["healthy"] * 2, "healthy again after SIGCONT")


def test_stopped_backend_is_ejected_and_no_request_fails(cluster):
    router, backends = cluster
    stopped = backends[1]
    ejections = httpx.get(f"{router.url}/backends").json()["backends"][1]["ejections"]
    stopped.stop()
    # the first request may still be sent to it: it is retried on the live backend before its first byte
    # (one at a time: the router caps each backend at one request in flight)
    client = _client(router.url)
    outs = [client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0.0)
            for _ in range(6)]
    assert [o.usage.completion_tokens for o in outs] == [4] * 6
    info = {b["url"]: b for b in httpx.get(f"{router.url}/backends").json()["backends"]}
    assert info[stopped.url]["state"] == "ejected" and info[stopped.url]["ejections"] > ejections
    assert info[backends[0].url]["state"] == "healthy"
    time.sleep(1.5)  # past the first ejection: the half-open probe fails, it stays out
    assert httpx.get(f"{router.url}/backends").json()["backends"][1]["state"] == "ejected"
    m = metric_samples(router.url)
    assert m[("tandem_router:ejections_total", (("backend", stopped.url),))] >= 1
    assert m[("tandem_router:backend_healthy", (("backend", stopped.url),))] == 0
    assert httpx.get(f"{router.url}/health").status_code == 200
