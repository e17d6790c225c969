"""The router's forwarding against scripted fake backends (httpx.MockTransport; no model, no sockets
except the KV-event test's loopback ZeroMQ)."""

import asyncio
import contextlib
import json
import time

import httpx
import pytest

from tandem.kv_cache.events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    hash_to_bytes,
    snapshot_batch,
)
from tandem.kv_cache.hashing import hash_token_blocks
from tandem.router.app import RouterService, build_app
from tandem.router.config import RouterConfig
from tandem.router.health import HealthState
from tandem.router.kv_index import ApproxBlockIndex, EnginesBlockIndex, EventBlockIndex
from tandem.router.kv_subscriber import endpoint_from_load, endpoints_from_load, reachable_endpoint

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


A, B, C = "http://a:1", "http://b:1", "http://c:1"
BODY = {"model": "m", "prompt": "hello world, a prompt of some length", "max_tokens": 4}
SSE = [b'data: {"choices":[{"text":"x"}]}\n\n', b'data: {"choices":[{"text":"y"}]}\n\n', b"data: [DONE]\n\n"]


class CharTokenizer:
    """One token per character; the chat template joins the contents."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def apply_chat_template(self, messages, chat_template=None, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class Stream(httpx.AsyncByteStream):
    def __init__(self, chunks, fail=False):
        self.chunks, self.fail = chunks, fail

    async def __aiter__(self):
        for c in self.chunks:
            yield c
        if self.fail:
            raise httpx.ReadError("backend died mid-stream")


class Fakes:
    """Scripted backends: ``script[url]`` is called with the request and returns a Response or raises."""

    def __init__(self, **load):
        self.calls: list[tuple[str, str]] = []
        self.script = {}
        self.load = load
        self.down: set[str] = set()  # backends that refuse connections
        self.silent: set[str] = set()  # backends whose new requests time out (hung: SIGSTOPped)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        self.calls.append((base, request.url.path))
        if base in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if base in self.silent:
            raise httpx.ReadTimeout("timed out", request=request)
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/load":
            return httpx.Response(200, json=self.load.get(base)) if base in self.load else httpx.Response(404)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "root": None}]})
        result = self.script[base](request)
        return await result if asyncio.iscoroutine(result) else result

    def posts(self, base=None):
        return [b for b, p in self.calls if p.startswith("/v1/") and p != "/v1/models" and (base in (None, b))]


def ok(request):
    return httpx.Response(200, json={"echo": json.loads(request.content), "auth": request.headers.get("authorization")},
                          headers={"x-backend": request.url.host})


def refuse(request):
    raise httpx.ConnectError("connection refused", request=request)


async def _start(fakes, *backends, **kw):
    kw.setdefault("policy", "least-load")
    kw.setdefault("health_interval_s", 3600.0)
    config = RouterConfig(backends=backends, **kw)
    service = RouterService(config, tokenizer=CharTokenizer(), transport=httpx.MockTransport(fakes.handle))
    await service.start()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(service)), base_url="http://router")
    return service, client


async def _stop(service, client):
    await client.aclose()
    await service.stop()


async def test_bodies_and_headers_pass_through_and_a_connect_error_is_retried_once():
    fakes = Fakes()
    fakes.script = {A: refuse, B: ok}
    service, client = await _start(fakes, A, B)
    r = await client.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer k"})
    assert r.status_code == 200 and r.headers["x-backend"] == "b"
    assert r.json() == {"echo": BODY, "auth": "Bearer k"}
    assert fakes.posts() == [A, B]
    assert service.backends[0].health.state is HealthState.EJECTED
    r = await client.post("/v1/completions", json=BODY)  # the ejected one is not tried again
    assert r.status_code == 200 and fakes.posts() == [A, B, B]
    metrics = (await client.get("/metrics")).text
    assert 'tandem_router:ejections_total{backend="http://a:1"} 1.0' in metrics
    assert "tandem_router:retries_total 1.0" in metrics
    assert 'tandem_router:errors_total{backend="http://a:1",kind="connect"} 1.0' in metrics
    assert 'tandem_router:requests_total{backend="http://b:1"} 2.0' in metrics
    answer = (await client.get("/backends")).json()
    assert {k: answer[k] for k in answer if k != "backends"} == {"policy": "least-load"}
    info = answer["backends"]
    assert [(x["url"], x["state"], x["outstanding_requests"]) for x in info] == [
        (A, "ejected", 0), (B, "healthy", 0)]
    await _stop(service, client)


async def test_5xx_is_retried_once_then_the_router_answers_502_naming_both(caplog):
    fakes = Fakes()
    fakes.script = {u: (lambda r, u=u: httpx.Response(500, json={"error": {"message": f"boom {u}"}}))
                    for u in (A, B, C)}
    service, client = await _start(fakes, A, B, C, policy="round-robin")
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 502 and r.json() == {"error": {
        "message": f"no backend answered: {A} answered 500; {B} answered 500",
        "type": "bad_gateway", "param": None, "code": "backend_failed"}}  # the backends' bodies are not relayed
    assert f"backend {A} answered 500: boom {A}" in caplog.text  # but logged
    assert fakes.posts() == [A, B]  # one retry, not a third attempt
    assert all(b.health.consecutive_failures == 1 for b in service.backends[:2])
    await _stop(service, client)


def _sse(chunks, fail=False):
    return lambda r: httpx.Response(200, stream=Stream(chunks, fail), headers={"content-type": "text/event-stream"})


async def test_a_stream_broken_before_its_first_chunk_is_retried_after_it_is_not():
    fakes = Fakes()
    fakes.script = {A: _sse([], fail=True), B: _sse(SSE)}
    service, client = await _start(fakes, A, B)
    r = await client.post("/v1/completions", json={**BODY, "stream": True})
    assert r.status_code == 200 and r.content == b"".join(SSE) and fakes.posts() == [A, B]
    assert service.backends[0].health.state is HealthState.EJECTED
    service.backends[0].health.on_probe(True)  # (not due yet: stays ejected)
    fakes.script = {A: _sse(SSE), B: _sse(SSE[:1], fail=True)}
    r = await client.post("/v1/completions", json={**BODY, "stream": True})
    events = r.content.split(b"\n\n")
    assert events[0] + b"\n\n" == SSE[0] and fakes.posts() == [A, B, B]  # not retried on A
    assert json.loads(events[1].removeprefix(b"data: "))["error"]["code"] == "backend_stream_broken"
    assert events[2:] == [b"data: [DONE]", b""]
    assert service.backends[1].health.state is HealthState.EJECTED
    assert [b.state.outstanding_requests for b in service.backends] == [0, 0]
    assert 'kind="stream"} 1.0' in (await client.get("/metrics")).text
    await _stop(service, client)


async def test_a_broken_json_body_drops_the_connection():
    fakes = Fakes()
    fakes.script = {A: lambda r: httpx.Response(200, stream=Stream([b'{"id": '], fail=True),
                                                headers={"content-type": "application/json"})}
    service, client = await _start(fakes, A)
    r = await client.post("/v1/completions", json=BODY)
    assert r.status_code == 502 and r.json()["error"]["code"] == "backend_unreachable"
    await _stop(service, client)


async def test_sse_passes_through_byte_for_byte():
    fakes = Fakes()
    fakes.script = {A: _sse(SSE)}
    service, client = await _start(fakes, A)
    async with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
        body = b"".join([c async for c in r.aiter_raw()])
        assert r.headers["content-type"] == "text/event-stream"
    assert body == b"".join(SSE)
    assert service.backends[0].state.outstanding_requests == 0
    await _stop(service, client)


async def test_backend_429s_pass_through_then_the_router_answers_429_itself():
    fakes = Fakes()
    busy = {"error": {"message": "queue full", "code": "queue_full"}}
    fakes.script = {u: (lambda r: httpx.Response(429, json=busy, headers={"Retry-After": "3"})) for u in (A, B)}
    service, client = await _start(fakes, A, B)
    r = await client.post("/v1/completions", json=BODY)
    assert (r.status_code, r.json(), r.headers["retry-after"]) == (429, busy, "3")
    assert fakes.posts() == [A, B]
    t0 = time.monotonic()
    r = await client.post("/v1/completions", json=BODY)  # both still busy: not even tried
    assert time.monotonic() - t0 < 1.0 and fakes.posts() == [A, B]
    assert r.status_code == 429 and r.json()["error"]["code"] == "all_backends_busy"
    assert int(r.headers["retry-after"]) in (2, 3)
    assert all(b.health.state is HealthState.HEALTHY for b in service.backends)  # busy is not sick
    await _stop(service, client)


async def test_router_cap_answers_429_without_waiting_and_503_without_healthy_backends():
    fakes = Fakes()
    release = asyncio.Event()

    async def slow(request):
        await release.wait()
        return ok(request)

    fakes.script = {A: slow, B: slow}
    service, client = await _start(fakes, A, B, max_outstanding_per_backend=1)
    held = [asyncio.create_task(client.post("/v1/completions", json=BODY)) for _ in range(2)]
    while len(fakes.posts()) < 2:
        await asyncio.sleep(0.01)
    r = await asyncio.wait_for(client.post("/v1/completions", json=BODY), 5.0)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"] == {"message": "every backend is at its limit; retry later", "type": "rate_limit_error",
                                 "param": None, "code": "all_backends_busy"}
    release.set()
    assert [x.status_code for x in await asyncio.gather(*held)] == [200, 200]
    assert sorted(fakes.posts()) == [A, B]
    for b in service.backends:
        b.health.eject("test")
    r = await client.post("/v1/completions", json=BODY)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_backend" and r.headers["retry-after"]
    assert (await client.get("/health")).status_code == 503
    await _stop(service, client)


async def test_kv_aware_keeps_a_shared_prefix_on_one_backend_without_events():
    fakes = Fakes()
    fakes.script = {A: ok, B: ok}
    service, client = await _start(fakes, A, B, policy="kv-aware", block_size=4)
    system = {"role": "system", "content": "a long shared system prompt " * 4}
    tok, hashes = CharTokenizer(), []
    for q in ("one?", "two?", "three?"):
        messages = [system, {"role": "user", "content": q}]
        r = await client.post("/v1/chat/completions", json={"messages": messages})
        assert r.status_code == 200
        hashes.append(hash_token_blocks(tok(tok.apply_chat_template(messages))["input_ids"], 4))
    shared = len(set(hashes[0]) & set(hashes[1]) & set(hashes[2]))
    other = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "unrelated"}]})
    assert other.status_code == 200
    first = fakes.posts()[0]
    assert fakes.posts()[:3] == [first] * 3
    answer = (await client.get("/backends")).json()
    assert (answer["policy"], answer["kv_beta"], answer["kv_min_match"]) == ("kv-aware", 0.5, 0.3)
    info = {x["url"]: x for x in answer["backends"]}
    assert info[first]["index"] == "approximate"
    unrelated = hash_token_blocks(tok(tok.apply_chat_template([{"role": "user", "content": "unrelated"}]))[
        "input_ids"], 4)
    total = sum(map(len, hashes)) + (len(unrelated) if fakes.posts()[3] == first else 0)
    assert info[first]["routed_prefix_hit_rate"] == pytest.approx(2 * shared / total)
    await _stop(service, client)


async def test_a_refused_request_leaves_no_blocks_in_the_approximate_index():
    """A 4xx / 5xx answer computed nothing: its prompt's blocks must not be predicted as cached later (the next
    real request's smaller reported hit would shrink the index's capacity for good)."""
    fakes = Fakes()
    bad = lambda request: httpx.Response(400, json={"error": {"message": "max_tokens too large"}})  # noqa: E731
    fakes.script = {A: bad}
    service, client = await _start(fakes, A, policy="kv-aware", block_size=4)
    a = service.backends[0]
    capacity = a.state.index.capacity_blocks
    r = await client.post("/v1/completions", json=BODY)
    assert r.status_code == 400 and len(a.state.index) == 0
    fakes.script = {A: lambda request: httpx.Response(500, json={"error": {"message": "boom"}})}
    assert (await client.post("/v1/completions", json=BODY)).status_code == 502
    assert len(a.state.index) == 0
    fakes.script = {A: ok}
    assert (await client.post("/v1/completions", json=BODY)).status_code == 200
    hashes = hash_token_blocks([ord(c) for c in BODY["prompt"]], 4)
    assert len(a.state.index) == len(hashes) and a.state.index.match(hashes) == len(hashes)
    assert a.state.index.capacity_blocks == capacity
    await _stop(service, client)


def test_wildcard_event_endpoints_are_reached_at_the_backend_host():
    assert reachable_endpoint("tcp://*:5557", "http://10.0.0.7:8000") == "tcp://10.0.0.7:5557"
    assert reachable_endpoint("tcp://0.0.0.0:5557", "http://gpu1:8000") == "tcp://gpu1:5557"
    assert reachable_endpoint("tcp://127.0.0.1:5557", "http://gpu1:8000") == "tcp://127.0.0.1:5557"
    assert endpoint_from_load({"kv_events": None}, A) is None
    assert endpoint_from_load({"kv_events": {"endpoint": "tcp://*:1", "replay_endpoint": "tcp://*:2", "topic": "t"}},
                              "http://h:9") == ("tcp://h:1", "t", "tcp://h:2")


async def test_kv_events_found_in_load_feed_the_index_from_a_snapshot_then_batches():
    publisher = KVEventPublisher("tcp://127.0.0.1:*", topic="kv", replay_endpoint="tcp://127.0.0.1:*")
    fakes = Fakes(**{A: {"block_size": 4, "num_kv_blocks": 64, "kv_events": {
        "endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint, "topic": "kv"}}})
    fakes.script = {A: ok, B: ok}
    hashes = hash_token_blocks([ord(c) for c in BODY["prompt"]], 4)
    old = KVEventBatch(ts=0.0, events=[BlockStored([hash_to_bytes(h) for h in hashes[:1]], 4)])
    publisher.publish(old)  # seq 0: before the router subscribed, in the snapshot below
    service, client = await _start(fakes, A, B, policy="kv-aware")
    a = service.backends[0]
    assert isinstance(a.state.index, EventBlockIndex) and service.router.reader.block_size == 4
    for _ in range(500):  # the engine loop's part: answer the snapshot request
        publisher.serve_requests(lambda: snapshot_batch(hashes[:2], 4))
        await asyncio.sleep(0.01)
        if a.subscriber.snapshots:
            break
    assert a.state.index.blocks == set(hashes[:2]) and a.state.index.next_seq == 1
    batch = KVEventBatch(ts=0.0, events=[BlockStored([hash_to_bytes(h) for h in hashes], 4)])
    for _ in range(200):  # NOTE: ZeroMQ's slow joiner: resend until one arrives
        publisher.publish(batch)
        await asyncio.sleep(0.01)
        if a.subscriber.received:
            break
    assert a.state.index.blocks == set(hashes)
    r = await client.post("/v1/completions", json=BODY)
    assert r.status_code == 200 and fakes.posts() == [A]
    info = (await client.get("/backends")).json()["backends"][0]
    assert info["index"] == "kv-events" and info["kv_events"]["snapshots"] == 1
    assert info["indexed_blocks"] == len(hashes) and info["routed_prefix_hit_rate"] == 1.0
    await _stop(service, client)
    publisher.close()


async def test_a_data_parallel_backend_is_indexed_per_engine_from_each_engines_events():
    """`tandem serve -dp 2 --kv-events-config ...` publishes per engine (``/load`` ``engines``): the router
    subscribes to each; the backend's match is the best engine's, and an eviction on that engine lowers it."""
    pubs = [KVEventPublisher("tcp://127.0.0.1:*") for _ in range(2)]
    engines = [{"engine": rank, "kv_events": {"endpoint": p.endpoint, "topic": ""}} for rank, p in enumerate(pubs)]
    fakes = Fakes(**{A: {"block_size": 4, "num_kv_blocks": 64, "kv_events": None, "data_parallel_size": 2,
                         "engines": engines}})
    fakes.script = {A: ok, B: ok}
    service, client = await _start(fakes, A, B, policy="kv-aware")
    a, b = service.backends
    assert isinstance(a.state.index, EnginesBlockIndex) and b.subscriber is None
    assert [sub.endpoint for sub in a.subscribers] == [p.endpoint for p in pubs]
    hashes = hash_token_blocks([ord(c) for c in BODY["prompt"]], 4)

    async def publish(rank: int, batch: KVEventBatch, done) -> None:
        for _ in range(300):  # NOTE: ZeroMQ's slow joiner: resend until it arrives
            pubs[rank].publish(batch)
            await asyncio.sleep(0.01)
            if done():
                return
        raise AssertionError(f"engine {rank}'s batch never arrived")

    stored = lambda hs: KVEventBatch(ts=0.0, events=[BlockStored([hash_to_bytes(h) for h in hs], 4)])  # noqa: E731
    await publish(0, stored(hashes[:1]), lambda: a.state.index.engines[0].blocks)
    await publish(1, stored(hashes), lambda: a.state.index.engines[1].blocks)
    assert a.state.index.match(hashes) == len(hashes) and a.state.index.blocks == set(hashes)
    info = (await client.get("/backends")).json()["backends"][0]
    assert info["index"] == "kv-events" and info["indexed_blocks"] == len(hashes)
    assert [x["endpoint"] for x in info["kv_events"]] == [p.endpoint for p in pubs]
    r = await client.post("/v1/completions", json=BODY)
    assert r.status_code == 200 and fakes.posts() == [A]
    removed = KVEventBatch(ts=0.0, events=[BlockRemoved([hash_to_bytes(h) for h in hashes[1:]])])
    await publish(1, removed, lambda: len(a.state.index.engines[1].blocks) == 1)
    a.state.index.pending.clear()  # NOTE: the request's own hold (its grace period) aside
    assert a.state.index.match(hashes) == 1  # engine 0 holds one block, engine 1 one: the best is 1
    await _stop(service, client)
    for p in pubs:
        p.close()


async def test_an_engine_core_restarted_inside_a_backend_gets_an_empty_index_and_its_new_feed():
    """A -dp server stays healthy while it restarts one engine core: the router follows its /load each probe.
    Engine 1 restarted on a new port (``tcp://...:*``): its index starts empty and is fed from the new port;
    engine 0 keeps its blocks. Engine 0 restarted on the same port (fixed endpoints): its index is emptied, as
    when /load reports it not healthy; the router's own pending holds go with it."""
    pubs = [KVEventPublisher("tcp://127.0.0.1:*") for _ in range(3)]

    def load(endpoints, restarts):
        return {"block_size": 4, "num_kv_blocks": 64, "kv_events": None, "instance_id": "one", "engines": [
            {"engine": r, "restarts": n, "kv_events": {"endpoint": e, "topic": ""}}
            for r, (e, n) in enumerate(zip(endpoints, restarts, strict=True))]}

    fakes = Fakes(**{A: load([pubs[0].endpoint, pubs[1].endpoint], [0, 0])})
    fakes.script = {A: ok}
    service, client = await _start(fakes, A, policy="kv-aware")
    a = service.backends[0]
    index = a.state.index
    index.engines[0].blocks.update({1, 2})
    index.engines[1].blocks.update({3, 4})
    index.pending.on_dispatch([7])
    await service._check(a)  # nothing restarted
    assert a.state.index is index and index.blocks == {1, 2, 3, 4}
    fakes.load[A] = load([pubs[0].endpoint, pubs[2].endpoint], [0, 1])
    await service._check(a)
    assert [sub.endpoint for sub in a.subscribers] == [pubs[0].endpoint, pubs[2].endpoint]
    assert index.engines[0].blocks == {1, 2} and index.engines[1].blocks == set() and index.match([7]) == 0
    batch = KVEventBatch(ts=0.0, events=[BlockStored([hash_to_bytes(9)], 4)])
    for _ in range(300):  # the new core's events reach the new index
        pubs[2].publish(batch)
        await asyncio.sleep(0.01)
        if index.engines[1].blocks:
            break
    assert index.engines[1].blocks == {9}
    fakes.load[A] = load([pubs[0].endpoint, pubs[2].endpoint], [1, 1])  # engine 0: same port, a new core
    await service._check(a)
    assert index.engines[0].blocks == set() and index.engines[1].blocks == {9}
    assert a.subscribers[0].endpoint == pubs[0].endpoint
    index.engines[0].blocks.update({5})
    index.pending.on_dispatch([5, 6])
    stopped = load([pubs[0].endpoint, pubs[2].endpoint], [1, 1])
    stopped["engines"][0]["healthy"] = False  # crash-looped: not restarted, its blocks are not served
    fakes.load[A] = stopped
    await service._check(a)
    assert index.engines[0].blocks == set() and index.engines[1].blocks == {9} and index.match([5, 6]) == 0
    fakes.load[A] = {**load([pubs[0].endpoint, pubs[2].endpoint], [1, 1]), "instance_id": "two"}
    await service._check(a)  # another server process at that URL: everything anew
    assert a.state.index is not index and a.state.index.blocks == set()
    await _stop(service, client)
    for p in pubs:
        p.close()


def test_engine_feeds_come_from_load_only_when_every_engine_publishes():
    one = {"endpoint": "tcp://*:5557", "topic": "kv", "replay_endpoint": None}
    url = "http://10.0.0.2:8000"
    assert endpoints_from_load({"kv_events": one}, url) == [("tcp://10.0.0.2:5557", "kv", None)]
    both = {"kv_events": None, "engines": [{"kv_events": one}, {"kv_events": {**one, "endpoint": "tcp://h:6"}}]}
    assert endpoints_from_load(both, url) == [("tcp://10.0.0.2:5557", "kv", None), ("tcp://h:6", "kv", None)]
    assert endpoints_from_load({"engines": [{"kv_events": one}, {"kv_events": None}]}, url) is None
    assert endpoints_from_load({"engines": []}, url) is None and endpoints_from_load({}, url) is None


async def test_a_client_gone_before_the_body_starts_leaves_nothing_outstanding():
    closed = []

    class Tracked(Stream):
        async def aclose(self):
            closed.append(True)

    fakes = Fakes()
    sse = {"content-type": "text/event-stream"}
    fakes.script = {A: lambda r: httpx.Response(200, stream=Tracked(SSE), headers=sse)}
    service, client = await _start(fakes, A, max_outstanding_per_backend=1)
    messages = [{"type": "http.request", "body": json.dumps({**BODY, "stream": True}).encode(), "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        raise OSError("the client went away")

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "root_path": "", "query_string": b"", "headers": [(b"content-type", b"application/json")],
             "server": ("router", 80), "client": ("127.0.0.1", 5)}
    with contextlib.suppress(Exception):
        await build_app(service)(scope, receive, send)
    assert fakes.posts() == [A] and closed == [True]
    assert service.backends[0].state.outstanding_requests == 0  # the cap of 1 is free again
    assert (await client.post("/v1/completions", json=BODY)).status_code == 200  # not a 429: the slot is free
    await _stop(service, client)


async def test_a_backend_up_after_the_router_is_discovered_then_subscribed():
    publisher = KVEventPublisher("tcp://127.0.0.1:*")
    fakes = Fakes()
    fakes.down = {A}
    fakes.script = {A: ok, B: ok}
    service, client = await _start(fakes, A, B, policy="kv-aware")
    a = service.backends[0]
    for _ in range(100):  # the health task's first round
        if a.health.state is HealthState.EJECTED:
            break
        await asyncio.sleep(0.01)
    assert a.health.state is HealthState.EJECTED and a.subscriber is None and not a.answered_load
    fakes.down = set()
    fakes.load[A] = {"block_size": 16, "kv_events": {"endpoint": publisher.endpoint, "topic": ""}}
    a.health.ejected_until = 0.0  # its ejection time is up
    await service._check(a)
    assert a.health.state is HealthState.HALF_OPEN
    assert a.subscriber is not None and a.subscriber.endpoint == publisher.endpoint
    assert isinstance(a.state.index, EventBlockIndex)
    await _stop(service, client)
    publisher.close()


async def test_unknown_paths_and_methods_get_openai_error_json():
    fakes = Fakes()
    fakes.script = {A: ok}
    service, client = await _start(fakes, A)
    r = await client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = await client.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    assert "POST" in r.headers["allow"]
    await _stop(service, client)


async def test_a_backend_back_as_another_process_or_without_events_gets_a_fresh_index():
    """A backend restarted while ejected holds none of the blocks indexed for it: its old index (551 blocks
    in a live run) kept drawing shared prefixes to it, and one restarted without KV events kept it forever."""
    publisher = KVEventPublisher("tcp://127.0.0.1:*")
    events = {"endpoint": publisher.endpoint, "topic": ""}
    fakes = Fakes(**{A: {"block_size": 16, "instance_id": "one", "kv_events": events}})
    fakes.script = {A: ok, B: ok}
    service, client = await _start(fakes, A, B, policy="kv-aware")
    a = service.backends[0]
    assert isinstance(a.state.index, EventBlockIndex) and a.subscriber.endpoint == publisher.endpoint

    async def back(load):
        a.state.index.blocks.add(123)
        a.health.eject("restarted")
        fakes.load[A] = load
        a.health.ejected_until = 0.0  # its time is up: the probe passes and the router reads its /load again
        await service._check(a)
        assert a.health.state is not HealthState.EJECTED

    await back({"block_size": 16, "instance_id": "one", "kv_events": events})  # the same process: kept
    assert a.state.index.blocks == {123}
    await back({"block_size": 16, "instance_id": "two", "kv_events": events})  # another one, same endpoint
    assert isinstance(a.state.index, EventBlockIndex) and a.state.index.blocks == set()
    assert a.subscriber.endpoint == publisher.endpoint
    await back({"block_size": 16, "instance_id": "three", "num_kv_blocks": 64, "kv_events": None})
    assert a.subscriber is None and isinstance(a.state.index, ApproxBlockIndex) and len(a.state.index) == 0
    await _stop(service, client)
    publisher.close()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_body_nested_too_deeply_is_a_400_in_openai_shape_not_a_500(path):
    fakes = Fakes()
    fakes.script = {A: ok}
    service, client = await _start(fakes, A)
    deep = "[" * 5000 + "]" * 5000
    raw = f'{{"model": "m", "prompt": {deep}, "messages": {deep}}}'
    r = await client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json() == {"error": {
        "message": "the request body is not valid JSON: nested too deeply", "type": "invalid_request_error",
        "param": None, "code": None}}
    assert fakes.posts() == []
    assert 'tandem_router:rejected_total{status="400"} 1.0' in (await client.get("/metrics")).text
    await _stop(service, client)
