"""The router's forwarding: choose a backend, pass the body and the response (SSE too) through unchanged.

One request's path:
1. ``PromptReader.read`` (in a worker thread: tokenizing holds the CPU) gives its block hashes and token
   cost; the policy chooses among the backends that are healthy, below their cap and not busy.
2. The raw body goes to ``{backend}{path}`` with the client's headers (minus hop-by-hop ones).
3. Until the response's first body chunk arrives nothing reaches the client, and a failure is
   retried **once** on another backend: a connect error (refused, reset, no response, a body that
   breaks before its first chunk; it ejects the backend), a 5xx status or no first byte within
   ``--first-byte-timeout`` (passive failures: ``--failure-threshold`` in a row eject it), or the
   backend ejected for silence (a ``/health`` probe or connect that timed out, e.g. on a SIGSTOPped
   server) while the request waited: every request waiting on it is cut short at once and retried (the
   first-byte timeout is Envoy's per-try timeout; SGLang's and vLLM's routers also retry a failed request
   on another worker). An ejection for a refusal (a draining server stops listening) leaves the requests
   it accepted waiting for its answer (``health.py``). A 429
   marks that backend busy for its ``Retry-After`` and the request tries the next one (not counted as
   a retry). After the first chunk nothing is retried: a stream that breaks later ends with an SSE
   error event and ``data: [DONE]`` (a non-SSE body: the connection drops), and the backend is ejected.
4. No backend left: a backend's 429 is relayed (with a ``Retry-After``) when one said so; after failed
   attempts the router answers 502 naming each failure (503 with ``Retry-After`` when no backend is
   healthy any more), never a backend's 5xx body; otherwise 429 when healthy backends exist but all
   are full, 503 when none is healthy; both with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tandem.gateway.upstream import sse_error_event
from tandem.router.backend import FirstByteWait, HttpBackend
from tandem.router.config import RouterConfig
from tandem.router.kv_index import ApproxBlockIndex
from tandem.router.metrics import RouterMetrics
from tandem.router.policy import NoBackendError, Policy, Ticket
from tandem.router.prompt import PromptReader, RoutedPrompt
from tandem.server.errors import APIError

logger = logging.getLogger(__name__)

# NOTE: hop-by-hop headers (RFC 9110 section 7.6.1) and those the HTTP stacks set themselves.
DROP_REQUEST_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
                 "proxy-authorization", "proxy-connection", "accept-encoding"}
DROP_RESPONSE_HEADERS = {"content-length", "content-encoding", "connection", "keep-alive", "transfer-encoding",
                         "date", "server"}


@dataclass
class _Opened:
    """A backend's answer: ``first`` body chunk and the ``rest`` (None for a 429 / 5xx, unread)."""

    response: httpx.Response
    first: bytes
    rest: AsyncIterator[bytes] | None


class _RelayResponse(StreamingResponse):
    """A streamed relay that closes its upstream and completes its ticket however it ends: a client
    that leaves before the body starts never runs the body generator's ``finally``."""

    def __init__(self, content: AsyncIterator[bytes], status_code: int, headers: dict[str, str],
                 on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, status_code, headers=headers)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


def filter_headers(headers: httpx.Headers | Sequence[tuple[str, str]], drop: set[str]) -> list[tuple[str, str]]:
    items = headers.multi_items() if isinstance(headers, httpx.Headers) else headers
    return [(k, v) for k, v in items if k.lower() not in drop]


class Router:
    """Forwards OpenAI requests over ``backends`` with ``policy``.

    Args:
        config: the router's settings. backends: its ``HttpBackend``s. policy: a ``policy.Policy``.
        reader: reads bodies into routing views. client: the HTTP client to the backends.
        metrics: the Prometheus series. clock: monotonic seconds.
    """

    def __init__(self, config: RouterConfig, backends: list[HttpBackend], policy: Policy, reader: PromptReader,
                 client: httpx.AsyncClient, metrics: RouterMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.backends = backends
        self.policy = policy
        self.reader = reader
        self.client = client
        self.metrics = metrics
        self._clock = clock

    def _choose(self, prompt: RoutedPrompt, tried: set[HttpBackend]) -> HttpBackend:
        """Raises NoBackendError subclasses (``policy.eligible``); tried and busy backends count as full.
        A second choice for one request (a retry, a 429's next backend) leaves round-robin's cursor."""
        exclude = [b.state for b in self.backends if b in tried or b.busy]
        chosen = self.policy.choose(prompt.block_hashes, [b.state for b in self.backends], exclude,
                                    retry=bool(tried))
        return next(b for b in self.backends if b.state is chosen)

    def _retry_after(self) -> float:
        waits = [b.busy_until - self._clock() for b in self.backends if b.busy]
        return max(min(waits), self.config.retry_after_s) if waits else self.config.retry_after_s

    def _reject(self, e: NoBackendError) -> Response:
        status = e.status_code
        self.metrics.rejected.labels(str(status)).inc()
        if status == 429:
            err = APIError(429, "every backend is at its limit; retry later", "rate_limit_error", None,
                           "all_backends_busy", self._retry_after())
        else:
            err = APIError(503, "no healthy backend", "service_unavailable", None, "no_healthy_backend",
                           self.config.retry_after_s)
        return err.response()

    async def forward(self, request: Request, path: str, chat: bool) -> Response:
        """Routes one POST (``path``: e.g. ``/v1/chat/completions``) and relays its response."""
        raw = await request.body()
        try:
            prompt = await asyncio.to_thread(self.reader.read, raw, chat)
        except RecursionError:  # NOTE: JSON nested deeper than the interpreter's recursion limit
            self.metrics.rejected.labels("400").inc()
            return APIError(400, "the request body is not valid JSON: nested too deeply", "invalid_request_error",
                            None, None).response()
        headers = filter_headers(request.headers.items(), DROP_REQUEST_HEADERS)
        tried: set[HttpBackend] = set()
        busy: Response | None = None  # a backend's 429, relayed when no other backend answers
        failures: list[str] = []  # attempts that failed before their first byte: two at most (one retry)
        retried = False
        while True:
            try:
                backend = self._choose(prompt, tried)
            except NoBackendError as e:
                return self._give_up(e, busy, failures)
            tried.add(backend)
            if failures and not retried:  # NOTE: counted once, whatever 429s the retry skips on its way
                retried = True
                self.metrics.retries.inc()
            ticket = self.policy.on_dispatch(backend.state, prompt.block_hashes, prompt.num_tokens)
            self.metrics.dispatched(backend.state, len(prompt.block_hashes), ticket.matched_blocks)
            opened = await self._send(backend, path, raw, headers, ticket)
            if isinstance(opened, str):
                failures.append(opened)
            elif opened.rest is not None:
                backend.health.on_response(opened.response.status_code)
                return await self._relay(backend, opened, ticket, prompt)
            elif opened.response.status_code == 429:
                busy = self._busy(backend, opened, ticket)
                continue
            else:
                failures.append(self._failed_status(backend, opened, ticket))
            if len(failures) > 1:
                return self._give_up(None, busy, failures)

    async def _send(self, backend: HttpBackend, path: str, raw: bytes, headers: list[tuple[str, str]],
                    ticket: Ticket) -> _Opened | str:
        """The backend's answer up to its first body chunk (for a 429 / 5xx: its whole body, ``rest`` None),
        or why there is none: a connect error (it ejects the backend), no first byte within
        ``first_byte_timeout_s`` (a passive failure), or the backend ejected while the request waited
        (``FirstByteWait``). A failure completes the ticket and is counted in ``errors_total``."""
        req = self.client.build_request("POST", f"{backend.url}{path}", content=raw, headers=headers)
        upstream = wait = None
        try:
            try:
                async with asyncio.timeout(self.config.first_byte_timeout_s or None) as deadline:
                    wait = FirstByteWait(deadline)
                    backend.waiting.add(wait)
                    upstream = await self.client.send(req, stream=True)
                    if upstream.status_code >= 500 or upstream.status_code == 429:
                        return _Opened(upstream, await self._read_refusal(upstream), None)
                    rest = upstream.aiter_bytes()  # NOTE: decoded, so Content-Encoding is not relayed
                    return _Opened(upstream, await anext(rest, b""), rest)
            finally:
                backend.waiting.discard(wait)
        except (httpx.HTTPError, TimeoutError) as e:
            if upstream is not None:
                await upstream.aclose()
            self.policy.on_complete(ticket)
            self._unrecord(backend, ticket)
            return self._attempt_failed(backend, e, wait)
        except BaseException:  # NOTE: cancelled (the client left): the ticket must still complete
            self.policy.on_complete(ticket)
            if upstream is not None:
                await upstream.aclose()
            raise

    @staticmethod
    async def _read_refusal(upstream: httpx.Response) -> bytes:
        try:
            return await upstream.aread()
        except httpx.HTTPError:
            return b""
        finally:
            await upstream.aclose()

    def _attempt_failed(self, backend: HttpBackend, e: Exception, wait: FirstByteWait | None) -> str:
        """Reports a failure before the first byte (metrics, health); returns it for the client's error."""
        if isinstance(e, TimeoutError) and wait is not None and wait.ejected:
            self.metrics.errors.labels(backend.url, "ejected").inc()  # NOTE: already ejected: not a new failure
            return f"{backend.url} was ejected while the request waited ({backend.health.last_error})"
        if isinstance(e, TimeoutError):
            reason = f"no response byte within {self.config.first_byte_timeout_s:g} s"
            self.metrics.errors.labels(backend.url, "timeout").inc()
            backend.health.on_failure(reason)
            return f"{backend.url}: {reason}"
        self.metrics.errors.labels(backend.url, "connect").inc()
        backend.health.on_connect_error(f"{type(e).__name__}: {e}", silent=isinstance(e, httpx.TimeoutException))
        return f"{backend.url}: {type(e).__name__}: {e}".rstrip(": ")

    def _busy(self, backend: HttpBackend, opened: _Opened, ticket: Ticket) -> Response:
        """A backend's 429: skipped for its ``Retry-After``; kept (with a ``Retry-After``) to relay."""
        self.policy.on_complete(ticket)
        self._unrecord(backend, ticket)
        upstream = opened.response
        backend.mark_busy(upstream.headers.get("retry-after"))
        backend.health.on_response(429)
        headers = dict(filter_headers(upstream.headers, DROP_RESPONSE_HEADERS))
        headers.setdefault("retry-after", str(max(1, math.ceil(self.config.retry_after_s))))
        return Response(opened.first, 429, headers=headers)

    def _failed_status(self, backend: HttpBackend, opened: _Opened, ticket: Ticket) -> str:
        """A backend's 5xx: a passive failure; returns ``"URL answered STATUS"`` for the client. The backend's
        own error message is logged, never relayed (a 5xx body may carry a server's internals)."""
        self.policy.on_complete(ticket)
        self._unrecord(backend, ticket)
        status = opened.response.status_code
        self.metrics.errors.labels(backend.url, "5xx").inc()
        backend.health.on_response(status)
        try:
            message = json.loads(opened.first)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = None
        if isinstance(message, str):
            logger.warning("backend %s answered %d: %s", backend.url, status, message[:200])
        return f"{backend.url} answered {status}"

    def _give_up(self, e: NoBackendError | None, busy: Response | None, failures: list[str]) -> Response:
        """The answer when no backend answered: a backend's 429 when one said so; after failures, 502 with
        each attempt's reason (503 with ``Retry-After`` when no backend is healthy any more); else the
        router's own 429 / 503 (``_reject``)."""
        if busy is not None:
            return busy
        if not failures:
            return self._reject(e)
        if any(b.state.healthy for b in self.backends):
            err = APIError(502, f"no backend answered: {'; '.join(failures)}", "bad_gateway", None,
                           "backend_failed")
        else:
            err = APIError(503, f"no healthy backend left: {'; '.join(failures)}", "service_unavailable", None,
                           "no_healthy_backend", self.config.retry_after_s)
        self.metrics.rejected.labels(str(err.status)).inc()
        return err.response()

    def _bad_gateway(self, backend: HttpBackend) -> Response:
        return APIError(502, f"the backend {backend.url} could not be reached", "bad_gateway", None,
                        "backend_unreachable").response()

    async def _relay(self, backend: HttpBackend, opened: _Opened, ticket: Ticket, prompt: RoutedPrompt) -> Response:
        upstream = opened.response
        if upstream.status_code >= 400:  # a 4xx passed through: the backend computed nothing
            self._unrecord(backend, ticket)
        headers = dict(filter_headers(upstream.headers, DROP_RESPONSE_HEADERS))
        if not prompt.stream and upstream.headers.get("content-type", "").startswith("application/json"):
            try:
                body = opened.first + b"".join([chunk async for chunk in opened.rest])
            except httpx.HTTPError as e:
                self._broken(backend, e)
                return self._bad_gateway(backend)
            finally:
                await upstream.aclose()
                self.policy.on_complete(ticket)
            self._observe_usage(backend, body, ticket)
            return Response(body, upstream.status_code, headers=headers)
        return _RelayResponse(self._chunks(backend, opened, ticket), upstream.status_code, headers=headers,
                              on_close=lambda: self._close(opened, ticket))

    async def _close(self, opened: _Opened, ticket: Ticket) -> None:
        await opened.response.aclose()
        self.policy.on_complete(ticket)

    async def _chunks(self, backend: HttpBackend, opened: _Opened, ticket: Ticket) -> AsyncIterator[bytes]:
        """The body as it comes; a break ends an SSE stream with an error event and ``[DONE]`` (as the
        server and the gateway do), any other body by dropping the connection."""
        try:
            if opened.first:
                yield opened.first
            async for chunk in opened.rest:
                yield chunk
        except httpx.HTTPError as e:
            self._broken(backend, e)
            if not opened.response.headers.get("content-type", "").startswith("text/event-stream"):
                raise
            yield sse_error_event(f"the backend stream broke: {type(e).__name__}")
            yield b"data: [DONE]\n\n"
        finally:
            await opened.response.aclose()
            self.policy.on_complete(ticket)

    @staticmethod
    def _unrecord(backend: HttpBackend, ticket: Ticket) -> None:
        """An approximate index forgets the blocks this request added on dispatch (the ones past its
        leading hit): the backend did not compute them (``ApproxBlockIndex.forget``)."""
        index = backend.state.index
        if isinstance(index, ApproxBlockIndex):
            index.forget(ticket.block_hashes[ticket.matched_blocks:])

    def _broken(self, backend: HttpBackend, e: Exception) -> None:
        self.metrics.errors.labels(backend.url, "stream").inc()
        backend.health.on_connect_error(f"response broken: {type(e).__name__}: {e}",
                                        silent=isinstance(e, httpx.TimeoutException))

    def _observe_usage(self, backend: HttpBackend, body: bytes, ticket: Ticket) -> None:
        """Corrects an approximate index from ``usage.prompt_tokens_details.cached_tokens``, if reported."""
        index = backend.state.index
        if not isinstance(index, ApproxBlockIndex) or not ticket.matched_blocks:
            return
        try:
            cached = json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]
        except (ValueError, KeyError, TypeError):
            return
        if isinstance(cached, int):
            index.observe_hit(ticket.matched_blocks, cached // self.reader.block_size)
