"""The router's failure handling before the first byte, against scripted fake backends
(httpx.MockTransport, no model): a hung backend is cut off by the first-byte timeout or by its
ejection and the request retried once elsewhere; 5xx and 429 answers; what the client gets when
every backend fails. Metrics are read back and compared as exact deltas."""

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.router.health import HealthState
from tests.unit.test_router_proxy import SSE, A, B, C, Fakes, Stream, _sse, _start, _stop, ok

pytestmark = pytest.mark.anyio
BODY = {"model": "m", "prompt": "a prompt", "max_tokens": 4}
LIMIT_S = 10.0  # NOTE: far below --request-timeout (600 s): a wait for the hung backend cannot pass


@pytest.fixture
def anyio_backend():
    return "asyncio"


class Hang:
    """A backend handler that never answers until ``release`` is set; counts its cancellations."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.cancelled = 0

    async def __call__(self, request):
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return ok(request)


async def _metrics(client) -> dict:
    text = (await client.get("/metrics")).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _delta(before: dict, after: dict) -> dict:
    """The counters that moved (``*_total`` samples only), by how much."""
    return {k: after[k] - before.get(k, 0.0) for k in after
            if k[0].endswith("_total") and after[k] != before.get(k, 0.0)}


def _errors(url, kind):
    return ("tandem_router:errors_total", (("backend", url), ("kind", kind)))


def _per(name, url):
    return (f"tandem_router:{name}_total", (("backend", url),))


RETRIES = ("tandem_router:retries_total", ())


def _rejected(status):
    return ("tandem_router:rejected_total", (("status", status),))


@pytest.mark.parametrize("stream", [False, True])
async def test_no_first_byte_in_time_is_retried_once_on_the_other_backend(stream):
    fakes, hang = Fakes(), Hang()
    fakes.script = {A: hang, B: _sse(SSE) if stream else ok}
    service, client = await _start(fakes, A, B, policy="round-robin", first_byte_timeout_s=1.0)
    before = await _metrics(client)
    t0 = time.monotonic()
    r = await asyncio.wait_for(client.post("/v1/completions", json={**BODY, "stream": stream}), LIMIT_S)
    elapsed = time.monotonic() - t0
    assert r.status_code == 200 and 1.0 <= elapsed < LIMIT_S
    assert r.content == b"".join(SSE) if stream else r.json()["echo"] == {**BODY, "stream": False}
    assert fakes.posts() == [A, B] and hang.cancelled == 1
    a = service.backends[0]
    assert (a.health.state, a.health.consecutive_failures) == (HealthState.HEALTHY, 1)  # 1 of 3: still routed
    assert a.health.last_error is None and not a.waiting
    assert _delta(before, await _metrics(client)) == {
        _per("requests", A): 1, _per("requests", B): 1, _errors(A, "timeout"): 1, RETRIES: 1}
    assert [b.state.outstanding_requests for b in service.backends] == [0, 0]
    await _stop(service, client)


async def test_a_stream_whose_headers_came_but_no_chunk_is_cut_at_the_first_byte_timeout():
    fakes, gate = Fakes(), asyncio.Event()

    class Silent(Stream):
        async def __aiter__(self):
            await gate.wait()
            yield SSE[0]

    fakes.script = {A: lambda r: httpx.Response(200, stream=Silent([]), headers={"content-type": "text/event-stream"}),
                    B: _sse(SSE)}
    service, client = await _start(fakes, A, B, policy="round-robin", first_byte_timeout_s=0.5)
    r = await asyncio.wait_for(client.post("/v1/completions", json={**BODY, "stream": True}), LIMIT_S)
    assert r.status_code == 200 and r.content == b"".join(SSE) and fakes.posts() == [A, B]
    await _stop(service, client)


async def test_timeouts_eject_at_the_failure_threshold():
    fakes, hang = Fakes(), Hang()
    fakes.script = {A: hang, B: ok}
    service, client = await _start(fakes, A, B, policy="round-robin", first_byte_timeout_s=0.3,
                                   failure_threshold=2)
    before = await _metrics(client)
    for _ in range(3):  # round-robin: A (retried on B), B, A (retried on B): a retry leaves the cursor
        r = await asyncio.wait_for(client.post("/v1/completions", json=BODY), LIMIT_S)
        assert r.status_code == 200
    assert fakes.posts() == [A, B, B, A, B]
    a = service.backends[0]
    assert a.health.state is HealthState.EJECTED and a.health.ejections == 1
    assert a.health.last_error == "2 consecutive failures, the last: no response byte within 0.3 s"
    assert _delta(before, await _metrics(client)) == {
        _per("requests", A): 2, _per("requests", B): 3, _errors(A, "timeout"): 2, RETRIES: 2,
        _per("ejections", A): 1}
    await _stop(service, client)


async def test_an_ejection_cuts_every_request_waiting_on_the_backend_and_each_is_retried():
    """No first-byte timeout: the requests hung on A wait until A's /health check times out, then go to B."""
    fakes, hang = Fakes(), Hang()
    fakes.script = {A: hang, B: ok}
    service, client = await _start(fakes, A, B, policy="round-robin", first_byte_timeout_s=0.0)
    before = await _metrics(client)
    waiting = []
    for n in (1, 2, 3):  # A, B (answers at once), A
        waiting.append(asyncio.create_task(client.post("/v1/completions", json=BODY)))
        while len(fakes.posts()) < n:
            await asyncio.sleep(0.01)
    a = service.backends[0]
    while len(a.waiting) < 2:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    assert not waiting[0].done() and not waiting[2].done()  # no timeout: they would wait for A
    fakes.silent = {A}
    t0 = time.monotonic()
    await service._check(a)  # the health task's probe of A times out: A is ejected, for silence
    done = await asyncio.wait_for(asyncio.gather(*waiting), LIMIT_S)
    assert time.monotonic() - t0 < LIMIT_S
    assert [r.status_code for r in done] == [200, 200, 200] and [r.headers["x-backend"] for r in done] == ["b"] * 3
    assert fakes.posts() == [A, B, A, B, B] and hang.cancelled == 2 and not a.waiting
    assert a.health.state is HealthState.EJECTED and a.health.ejections == 1
    assert _delta(before, await _metrics(client)) == {
        _per("requests", A): 2, _per("requests", B): 3, _errors(A, "ejected"): 2, _errors(A, "probe"): 1,
        _per("ejections", A): 1, RETRIES: 2}
    await _stop(service, client)


async def test_a_draining_backend_ejected_by_a_refused_probe_still_answers_the_requests_it_accepted():
    """SIGTERM to a backend: it stops listening (its probe is refused: ejected) and finishes the requests it
    has. Those keep waiting for its answers, even with no other backend to retry on (they got 503 before);
    a new request gets the router's 503 at once."""
    fakes, hang = Fakes(), Hang()
    fakes.script = {A: hang}
    service, client = await _start(fakes, A, policy="round-robin", first_byte_timeout_s=0.0)
    waiting = [asyncio.create_task(client.post("/v1/completions", json={**BODY, "n": i})) for i in range(3)]
    a = service.backends[0]
    while len(a.waiting) < 3:
        await asyncio.sleep(0.01)
    before = await _metrics(client)
    fakes.down = {A}
    await service._check(a)
    assert (a.health.state, a.health.last_silent) == (HealthState.EJECTED, False)
    await asyncio.sleep(0.2)
    assert not any(t.done() for t in waiting) and len(a.waiting) == 3
    late = await asyncio.wait_for(client.post("/v1/completions", json=BODY), LIMIT_S)
    assert late.status_code == 503 and "retry-after" in late.headers
    hang.release.set()
    done = await asyncio.wait_for(asyncio.gather(*waiting), LIMIT_S)
    assert [r.status_code for r in done] == [200] * 3
    assert [r.json()["echo"]["n"] for r in done] == [0, 1, 2] and hang.cancelled == 0 and not a.waiting
    assert fakes.posts() == [A] * 3
    assert _delta(before, await _metrics(client)) == {
        _errors(A, "probe"): 1, _per("ejections", A): 1, _rejected("503"): 1}
    assert a.state.outstanding_requests == 0
    await _stop(service, client)


async def test_a_stream_under_way_is_not_cut_by_an_ejection_nor_retried():
    fakes, gate = Fakes(), asyncio.Event()

    class Paused(Stream):
        async def __aiter__(self):
            yield SSE[0]
            await gate.wait()
            for c in SSE[1:]:
                yield c

    fakes.script = {A: lambda r: httpx.Response(200, stream=Paused([]), headers={"content-type": "text/event-stream"}),
                    B: _sse(SSE)}
    service, client = await _start(fakes, A, B, policy="round-robin", first_byte_timeout_s=0.5)
    a = service.backends[0]

    async def eject_mid_stream():
        while fakes.posts() != [A] or a.waiting:  # A's first chunk is in: the stream is under way
            await asyncio.sleep(0.01)
        a.health.eject("test: ejected while its stream runs")
        await asyncio.sleep(0.7)  # past the first-byte timeout too: it no longer applies
        gate.set()

    # NOTE: httpx's ASGITransport hands over the body once the app finished it
    ejecting = asyncio.create_task(eject_mid_stream())
    r = await asyncio.wait_for(client.post("/v1/completions", json={**BODY, "stream": True}), LIMIT_S)
    await ejecting
    assert r.status_code == 200 and r.content == b"".join(SSE) and fakes.posts() == [A]
    assert a.health.state is HealthState.EJECTED
    m = await _metrics(client)
    assert m[RETRIES] == 0 and m[_errors(A, "ejected")] == 0 and m[_errors(A, "timeout")] == 0
    await _stop(service, client)


async def test_the_retry_happens_once_then_502_names_both_failures():
    fakes, hang = Fakes(), Hang()
    fakes.script = {A: hang, B: hang, C: ok}
    service, client = await _start(fakes, A, B, C, policy="round-robin", first_byte_timeout_s=0.3)
    before = await _metrics(client)
    r = await asyncio.wait_for(client.post("/v1/completions", json=BODY), LIMIT_S)
    assert r.status_code == 502 and "retry-after" not in r.headers
    assert r.json() == {"error": {
        "message": f"no backend answered: {A}: no response byte within 0.3 s; {B}: no response byte within 0.3 s",
        "type": "bad_gateway", "param": None, "code": "backend_failed"}}
    assert fakes.posts() == [A, B] and hang.cancelled == 2  # C is never tried: one retry only
    assert _delta(before, await _metrics(client)) == {
        _per("requests", A): 1, _per("requests", B): 1, _errors(A, "timeout"): 1, _errors(B, "timeout"): 1,
        RETRIES: 1, _rejected("502"): 1}
    await _stop(service, client)


@pytest.mark.parametrize("status", [500, 502, 503, 504])
async def test_a_5xx_before_the_body_is_a_passive_failure_and_is_retried(status):
    fakes = Fakes()
    fakes.script = {A: lambda r: httpx.Response(status, json={"error": {"message": "engine died"}}), B: ok}
    service, client = await _start(fakes, A, B, policy="round-robin", failure_threshold=2)
    before = await _metrics(client)
    for _ in range(3):  # A (retried on B), B, A (retried on B)
        r = await client.post("/v1/completions", json=BODY)
        assert r.status_code == 200 and r.headers["x-backend"] == "b"
    assert fakes.posts() == [A, B, B, A, B]
    a = service.backends[0]
    assert a.health.state is HealthState.EJECTED
    assert a.health.last_error == f"2 consecutive failures, the last: answered {status}"
    assert _delta(before, await _metrics(client)) == {
        _per("requests", A): 2, _per("requests", B): 3, _errors(A, "5xx"): 2, RETRIES: 2, _per("ejections", A): 1}
    r = await client.post("/v1/completions", json=BODY)  # ejected: not tried
    assert r.status_code == 200 and fakes.posts()[-1] == B and len(fakes.posts()) == 6
    await _stop(service, client)


async def test_every_backend_failing_and_ejected_gives_503_with_retry_after():
    fakes = Fakes()
    fakes.script = {A: lambda r: httpx.Response(500, text="not json"), B: lambda r: httpx.Response(503)}
    service, client = await _start(fakes, A, B, policy="round-robin", failure_threshold=1)
    r = await client.post("/v1/completions", json=BODY)
    assert (r.status_code, r.headers["retry-after"]) == (503, "1")
    assert r.json() == {"error": {"message": f"no healthy backend left: {A} answered 500; {B} answered 503",
                                  "type": "service_unavailable", "param": None, "code": "no_healthy_backend"}}
    assert _rejected("503") in _delta({}, await _metrics(client))
    await _stop(service, client)


async def test_a_single_backend_that_refuses_gives_503_naming_the_error():
    fakes = Fakes()
    fakes.script = {A: lambda r: (_ for _ in ()).throw(httpx.ConnectError("connection refused", request=r))}
    service, client = await _start(fakes, A)
    r = await client.post("/v1/completions", json=BODY)
    assert (r.status_code, r.headers["retry-after"]) == (503, "1")
    assert r.json()["error"]["message"] == f"no healthy backend left: {A}: ConnectError: connection refused"
    await _stop(service, client)


async def test_a_429_goes_elsewhere_and_comes_back_as_429_with_retry_after_never_500():
    fakes = Fakes()
    busy = {"error": {"message": "queue full", "code": "queue_full"}}
    fakes.script = {A: lambda r: httpx.Response(429, json=busy), B: ok}
    service, client = await _start(fakes, A, B, policy="round-robin")
    before = await _metrics(client)
    r = await client.post("/v1/completions", json=BODY)
    assert r.status_code == 200 and fakes.posts() == [A, B]
    assert _delta(before, await _metrics(client)) == {_per("requests", A): 1, _per("requests", B): 1}  # no retry
    service.backends[0].busy_until = 0.0
    fakes.script[B] = lambda r: httpx.Response(500, json={"error": {"message": "boom"}})
    r = await client.post("/v1/completions", json=BODY)  # A: 429 without Retry-After, B: 500
    assert (r.status_code, r.json(), r.headers["retry-after"]) == (429, busy, "1")
    assert fakes.posts()[2:] in ([A, B], [B, A])
    await _stop(service, client)


async def test_a_hung_health_check_holds_up_no_other_backends_probes():
    fakes, hung = Fakes(), asyncio.Event()
    fakes.script = {A: ok, B: ok}
    handle = fakes.handle

    async def health_hangs_on_a(request):
        if request.url.host == "a" and request.url.path == "/health":
            fakes.calls.append((A, "/health"))
            await hung.wait()  # NOTE: MockTransport enforces no timeout: A's probe never returns
        return await handle(request)

    fakes.handle = health_hangs_on_a
    service, client = await _start(fakes, A, B, health_interval_s=0.05)
    await asyncio.sleep(0.6)
    probes = [b for b, p in fakes.calls if p == "/health"]
    assert probes.count(A) == 1 and probes.count(B) >= 4
    await _stop(service, client)


async def test_a_backend_whose_health_passes_while_requests_hang_is_ejected_at_the_threshold():
    """/health answers 200 between the timeouts (its probe runs after each request): the count of real
    requests' failures is kept, and round-robin's retry leaves the cursor, so only every other request
    waits on the hung backend."""
    fakes, hang = Fakes(), Hang()
    fakes.script = {A: hang, B: _sse(SSE)}
    service, client = await _start(fakes, A, B, policy="round-robin", first_byte_timeout_s=0.3)
    a = service.backends[0]
    before = await _metrics(client)
    for _ in range(6):
        r = await asyncio.wait_for(client.post("/v1/completions", json={**BODY, "stream": True}), LIMIT_S)
        assert r.status_code == 200 and r.content == b"".join(SSE)
        await service._check(a)  # the health task's probe of A: 200
    assert fakes.posts() == [A, B, B, A, B, B, A, B, B]
    assert a.health.state is HealthState.EJECTED and a.health.ejections == 1
    assert a.health.last_error == "3 consecutive failures, the last: no response byte within 0.3 s"
    assert _delta(before, await _metrics(client)) == {
        _per("requests", A): 3, _per("requests", B): 6, _errors(A, "timeout"): 3, RETRIES: 3,
        _per("ejections", A): 1}
    await _stop(service, client)
