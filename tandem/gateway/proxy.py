"""The gateway's request path: choose a backend (canary), try the backends in order (fallback,
breakers, retry budget), relay the answer unchanged, account for it once.

Fallback happens only before the first byte reached the client: on a connect error, a 5xx, or no
first byte within `first_byte_timeout_s`. Once bytes flowed, a broken stream cannot be retried
elsewhere without the client seeing two answers, so it is ended with an SSE error event and
`data: [DONE]` (OpenAI's streaming error shape), and counted against the backend.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tandem.gateway.canary import CanaryController, Outcome
from tandem.gateway.capture import Capture, StreamTap, capture_body
from tandem.gateway.config import CANDIDATE, PRIMARY, GatewayConfig, redact_text
from tandem.gateway.health import STATE_CODES, CircuitBreaker, RetryBudget
from tandem.gateway.metrics import GatewayMetrics
from tandem.gateway.rewrite import AnswerFilter, listing_rewrite, rewrite_request
from tandem.gateway.shadow import ShadowRunner
from tandem.gateway.upstream import (
    BACKEND_HEADER,
    AttemptFailed,
    Opened,
    backend_headers,
    error_json,
    fetch_capture,
    open_attempt,
    sse_error_event,
)

logger = logging.getLogger(__name__)
GENERATION_PATHS = ("completions", "chat/completions")


async def _chain(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for chunk in rest:
        yield chunk


async def _read_body(request: Request, limit: int) -> bytes | None:
    """The request body, or None once it is longer than `limit` bytes (by its Content-Length, or
    while it is read: a chunked body is not buffered past the limit)."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        return None
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            return None
        parts.append(part)
    return b"".join(parts)


class EventLog:
    """Numbered gateway events (rollback, promotion, breaker changes), the last 200 kept."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: deque[dict[str, Any]] = deque(maxlen=200)

    def add(self, kind: str, message: str) -> None:
        self.seq += 1
        self.items.append({"seq": self.seq, "at": time.time(), "kind": kind, "message": message})
        logger.warning("gateway: %s: %s", kind, message)


class Gateway:
    """State of one gateway: backends, breakers, retry budget, canary, shadow, totals, metrics.

    `start()` opens the HTTP client, `close()` ends shadow legs and closes it.
    """

    def __init__(self, config: GatewayConfig, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self.config = config
        self._clock = clock
        self.backends = {b.name: b for b in config.backends()}
        fb = config.fallback
        self.breakers = {n: CircuitBreaker(fb.breaker_failures, fb.breaker_cooldown_s, clock) for n in self.backends}
        self.budget = RetryBudget(fb.retry_ratio, fb.min_retries, config.gates.window_s, clock)
        self.canary = CanaryController(config.canary, config.gates, config.candidate is not None, clock, rng)
        self.metrics = GatewayMetrics()
        self.shadow = ShadowRunner(config.shadow, self._shadow_fetch, self._on_compared,
                                   lambda result: self.metrics.shadow.labels(result).inc(), rng)
        self.metrics.shadow_in_flight.set_function(lambda: self.shadow.in_flight)
        self.events = EventLog()
        self.totals = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "fallbacks": 0}
        self.client: httpx.AsyncClient | None = None
        self._rollback_logged, self._promotions_logged = False, 0
        self._sync_gauges()

    async def start(self) -> None:
        fb = self.config.fallback
        timeout = httpx.Timeout(fb.read_timeout_s, connect=fb.first_byte_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)

    async def close(self) -> None:
        await self.shadow.close()
        if self.client is not None:
            await self.client.aclose()

    # ---- bookkeeping ----
    def _sync_gauges(self) -> None:
        """Mirrors the canary and breakers into the gauges; logs a rollback or promotion once."""
        m, c = self.metrics, self.canary
        m.canary_weight.set(c.weight)
        m.rolled_back.set(1.0 if c.rolled_back else 0.0)
        if c.rolled_back and not self._rollback_logged:
            self._rollback_logged = True
            m.rollbacks.inc()
            self.events.add("rollback", c.rollback_reason)
        elif c.promotions > self._promotions_logged:
            self._promotions_logged = c.promotions
            m.promotions.inc()
            self.events.add("promotion", f"step {c.step_index}: candidate weight {c.weight:g}")
        for name, breaker in self.breakers.items():
            m.breaker_state.labels(name).set(STATE_CODES[breaker.state])

    def _breaker(self, name: str, ok: bool) -> None:
        breaker, before = self.breakers[name], self.breakers[name].state
        breaker.record_success() if ok else breaker.record_failure()
        if breaker.state != before:
            if breaker.state == "open":
                self.metrics.breaker_opened.labels(name).inc()
            self.events.add("breaker", f"{name}: {before} -> {breaker.state}")
        self._sync_gauges()

    def _outcome(self, name: str, ok: bool, capture: Capture | None = None) -> None:
        ttft = capture.ttft_s if capture and ok else None
        self.canary.record(Outcome(self._clock(), name, ok, ttft, capture.tpot_s() if capture and ok else None))
        if ttft is not None:
            self.metrics.ttft.labels(name).observe(ttft)
        self._sync_gauges()

    def _on_compared(self, diverged: bool, tiers: set[str]) -> None:
        for tier in tiers:
            self.metrics.shadow_divergences.labels(tier).inc()
        self.canary.record_comparison(diverged)
        self._sync_gauges()

    def _settle(self, name: str, capture: Capture, generation: bool) -> None:
        """Accounts one client request, once: usage totals, counters, breaker, canary outcome."""
        ok = capture.status is not None and capture.status < 500 and not capture.error
        self.metrics.requests.labels(name, "ok" if ok else "error").inc()
        usage = capture.usage or {}
        for kind in ("prompt_tokens", "completion_tokens"):
            if isinstance(usage.get(kind), int):
                self.totals[kind] += usage[kind]
                self.metrics.usage_tokens.labels(kind).inc(usage[kind])
        self._breaker(name, ok)
        if generation:
            self._outcome(name, ok, capture)

    # ---- the request path ----
    def order(self, chosen: str) -> list[str]:
        return [chosen] + [n for n in self.backends if n != chosen]

    async def handle(self, request: Request, path: str) -> Response:
        """Proxies one client request to `path` (under /v1) and returns the answer to relay."""
        limit = int(self.config.max_body_mib * 2**20)
        raw = await _read_body(request, limit)
        if raw is None:
            message = f"the request body is larger than {self.config.max_body_mib:g} MiB (--max-body-mib)"
            body = error_json(413, message, "request_too_large")
            return JSONResponse(body, status_code=413)
        try:
            parsed: Any = json.loads(raw) if raw else None
        except ValueError:
            parsed = None
        generation = request.method == "POST" and path in GENERATION_PATHS and isinstance(parsed, dict)
        sticky = request.headers.get(self.config.canary.sticky_header)
        if sticky is None and isinstance(parsed, dict) and isinstance(parsed.get("user"), str):
            sticky = parsed["user"]
        chosen = self.canary.choose(sticky) if generation else PRIMARY
        self.totals["requests"] += 1
        self.budget.record_request()
        shadow = None
        if generation and chosen == PRIMARY and CANDIDATE in self.backends:
            shadow = self.shadow.maybe_launch(parsed, raw, path, dict(request.headers))
        start = time.perf_counter()
        try:
            response = await self._attempts(request, path, raw, parsed, chosen, generation, shadow, start)
        except BaseException:
            if shadow is not None and not shadow.done():
                shadow.set_result(None)
            raise
        return response

    async def _attempts(self, request: Request, path: str, raw: bytes, parsed: Any, chosen: str,
                        generation: bool, shadow, start: float) -> Response:
        failures: list[str] = []  # NOTE: each backend's configured name and why it did not answer
        last: AttemptFailed | None = None
        tried = 0
        for name in self.order(chosen):
            if not self.breakers[name].allow():
                failures.append(f"{name}: circuit breaker open")
                continue
            if tried and not self.budget.try_spend():
                self.metrics.retry_budget_exhausted.inc()
                failures.append(f"{name}: not tried, the retry budget is spent")
                break
            tried += 1
            backend = self.backends[name]
            own_path, rewrite = path, rewrite_request(backend, raw, parsed, generation)
            if request.method == "GET" and (path == "models" or path.startswith("models/")):
                own_path, rewrite = listing_rewrite(backend, raw, path)
            try:
                opened = await open_attempt(
                    self.client, backend, request.method, f"v1/{own_path}", request.url.query,
                    backend_headers(backend, request.headers), rewrite.body,
                    self.config.fallback.first_byte_timeout_s)
            except AttemptFailed as e:
                last = e
                failures.append(str(e))
                self.metrics.attempt_failures.labels(name, e.reason).inc()
                self._breaker(name, False)
                if generation:
                    self._outcome(name, False)
                logger.info("gateway: attempt at %s failed: %s", name, e)
                continue
            if shadow is not None and name != PRIMARY:
                shadow.set_result(None)  # NOTE: the primary did not answer; there is nothing to compare
                shadow = None
            if name != chosen:
                self.totals["fallbacks"] += 1
                self.metrics.fallbacks.labels(chosen, name).inc()
            return await self._relay(name, opened, AnswerFilter(rewrite), generation, shadow, start)
        if shadow is not None and not shadow.done():
            shadow.set_result(None)
        return self._unavailable(last, failures)

    def _unavailable(self, last: AttemptFailed | None, failures: list[str]) -> Response:
        """The answer when no backend answered: the last 5xx as it was (`x-tandem-backend` naming
        who sent it), else the gateway's 502/503/504 whose message names each backend and why."""
        self.metrics.requests.labels("none", "unavailable").inc()
        if last is not None and last.status is not None:
            headers = {k: v for k, v in last.headers.items() if k.lower() in ("content-type", "retry-after")}
            return Response(last.body, status_code=last.status, headers={**headers, BACKEND_HEADER: last.backend})
        why = "; ".join(failures)
        if last is None:
            wait = min(b.retry_after_s() for b in self.breakers.values()) or 1.0
            body = error_json(503, f"every backend's circuit breaker is open ({why})", "backends_unavailable")
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(max(1, round(wait)))})
        status = 504 if last.reason == "timeout" else 502
        return JSONResponse(error_json(status, f"no backend answered ({why})", last.reason), status_code=status)

    async def _relay(self, name: str, opened: Opened, answer: AnswerFilter, generation: bool, shadow,
                     start: float) -> Response:
        """The client's response from an opened backend answer; `answer` undoes the request's rewrite
        (the capture, for usage and the comparator, sees the backend's own bytes)."""
        status, headers = opened.response.status_code, opened.client_headers(self.backends[name])
        if not opened.is_sse:
            try:
                raw = opened.first + b"".join([chunk async for chunk in opened.rest])
            except httpx.HTTPError as e:
                raw, capture = b"", Capture(status=status, error=f"{name}: the body broke: {type(e).__name__}")
            else:
                capture = capture_body(status, raw, start)
            finally:
                await opened.response.aclose()
            self._settle(name, capture, generation)
            if shadow is not None and not shadow.done():
                shadow.set_result(capture)
            if capture.error:
                return JSONResponse(error_json(502, capture.error, "backend_body_broken"), status_code=502)
            return Response(answer.json_body(raw), status_code=status, headers=headers)
        tap = StreamTap(start, keep_events=shadow is not None)
        return StreamingResponse(self._stream(name, opened, answer, tap, generation, shadow), status_code=status,
                                 headers=headers)

    async def _stream(self, name: str, opened: Opened, answer: AnswerFilter, tap: StreamTap, generation: bool,
                      shadow) -> AsyncIterator[bytes]:
        settled, tail = False, b"\n\n"
        try:
            error = ""
            try:
                async for chunk in _chain(opened.first, opened.rest):
                    tap.feed(chunk)
                    if out := answer.feed(chunk):
                        tail = (tail + out)[-2:]
                        yield out
            except httpx.HTTPError as e:
                error = type(e).__name__
            if out := answer.finish():
                tail = (tail + out)[-2:]
                yield out
            capture = tap.finish(error)
            if capture.error and not capture.done:
                self.metrics.midstream_failures.labels(name).inc()
                if tail != b"\n\n":  # NOTE: the backend broke inside an event; end it so ours parses
                    yield b"\n\n"
                yield sse_error_event(f"{name}: the backend stream broke after its first byte ({capture.error})")
                yield b"data: [DONE]\n\n"
            settled = True
            self._settle(name, capture, generation)
            if shadow is not None and not shadow.done():
                shadow.set_result(capture)
        finally:
            if not settled and tap.capture.done:
                # NOTE: the backend's whole answer, `[DONE]` included, was handed on and the client
                # closed (the openai client does right after `[DONE]`) before this generator resumed:
                # a complete answer, accounted as one.
                capture = tap.finish()
                self._settle(name, capture, generation)
                if shadow is not None and not shadow.done():
                    shadow.set_result(capture)
            elif not settled:  # NOTE: the client went away; the request is not the backend's failure
                self.breakers[name].probe_in_flight = False
                if shadow is not None and not shadow.done():
                    shadow.set_result(None)
            await opened.response.aclose()

    async def _shadow_fetch(self, parsed: dict[str, Any], raw: bytes, path: str, headers: dict[str, str]) -> Capture:
        """One shadow leg to the candidate, read whole; never touches breakers or usage totals."""
        backend = self.backends[CANDIDATE]
        body = rewrite_request(backend, raw, parsed, generation=True).body
        return await fetch_capture(self.client, backend, f"v1/{path}", backend_headers(backend, headers, shadow=True),
                                   body, self.config.shadow.timeout_s)

    def status(self) -> dict[str, Any]:
        """The /gateway/status document (backend URLs without their userinfo, no keys)."""
        window = self.canary.window_stats()
        return {
            "backends": {n: {"url": redact_text(b.url), "breaker": self.breakers[n].snapshot(), "window": window.get(n)}
                         for n, b in self.backends.items()},
            "canary": self.canary.snapshot(), "shadow": self.shadow.snapshot(), "totals": dict(self.totals),
            "retry_budget": {"ratio": self.budget.ratio, "min_retries": self.budget.min_retries,
                             "exhausted": self.budget.exhausted},
            "events": list(self.events.items)[-50:], "event_seq": self.events.seq,
        }

