"""One attempt at one backend: headers and body as the backend must see them, the send, and the
wait for the first byte.

The client's `Authorization` never leaves the gateway: each backend gets its own key (or none).
Hop-by-hop headers (RFC 9110 section 7.6.1) and the length are dropped, `Accept-Encoding: identity`
is asked so the bytes the gateway relays are the ones it reads. The body is forwarded byte for byte
unless `rewrite.py` changes it (a mapped model name, stream usage asked for).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from tandem.gateway.capture import Capture, StreamTap, capture_body
from tandem.gateway.config import BackendConfig, redact_text, strip_userinfo

SHADOW_HEADER = "x-tandem-shadow"
BACKEND_HEADER = "x-tandem-backend"
_DROP_REQUEST = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                 "trailers", "transfer-encoding", "upgrade", "host", "content-length", "authorization",
                 "accept-encoding", "api-key", "x-api-key"}
_DROP_RESPONSE = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                  "trailers", "transfer-encoding", "upgrade", "content-length", "date", "server"}


class AttemptFailed(Exception):
    """A backend failed before the first byte. backend: its configured name (the message starts
    with it); reason: connect_error, timeout, http_5xx; status/body/headers: the 5xx answer, kept to
    relay when no backend does better."""

    def __init__(self, backend: str, reason: str, message: str, status: int | None = None, body: bytes = b"",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(redact_text(f"{backend}: {message}"))
        self.backend, self.reason, self.status, self.body, self.headers = backend, reason, status, body, headers or {}


@dataclass
class Opened:
    """A backend's answer whose head and first chunk arrived; `rest` yields the remaining bytes."""

    response: httpx.Response
    first: bytes
    rest: Any

    @property
    def is_sse(self) -> bool:
        return self.response.headers.get("content-type", "").startswith("text/event-stream")

    def client_headers(self, backend: BackendConfig) -> dict[str, str]:
        """The backend's response headers for the client, plus which backend answered. A redirect
        to the backend's own URL (e.g. a trailing-slash 307) is made relative, so that the client
        follows it through the gateway and never learns the backend's address."""
        out = {k: v for k, v in self.response.headers.items() if k.lower() not in _DROP_RESPONSE}
        origin = strip_userinfo(backend.url)
        for key in [k for k in out if k.lower() == "location"]:
            if out[key] == origin or out[key].startswith(origin + "/"):
                out[key] = out[key][len(origin):] or "/"
        out[BACKEND_HEADER] = backend.name
        return out


def backend_headers(backend: BackendConfig, incoming: Any, shadow: bool = False) -> dict[str, str]:
    """Headers to send to `backend`: the client's end-to-end headers, the backend's own key."""
    out = {k: v for k, v in incoming.items() if k.lower() not in _DROP_REQUEST and k.lower() != SHADOW_HEADER}
    out["accept-encoding"] = "identity"
    if backend.api_key:
        out["authorization"] = f"Bearer {backend.api_key}"
    if shadow:
        out[SHADOW_HEADER] = "1"
    return out


async def open_attempt(client: httpx.AsyncClient, backend: BackendConfig, method: str, path: str, query: str,
                       headers: dict[str, str], body: bytes, first_byte_timeout_s: float) -> Opened:
    """Sends the request and waits for the response head and its first body chunk.

    Raises AttemptFailed on a connect/transport error, a 5xx, or no first byte within the timeout
    (the response is closed in each case).
    """
    url = f"{backend.url}/{path}" + (f"?{query}" if query else "")
    request = client.build_request(method, url, content=body, headers=headers)
    response: httpx.Response | None = None
    try:
        async with asyncio.timeout(first_byte_timeout_s):
            response = await client.send(request, stream=True)
            if response.status_code >= 500:
                raw = await response.aread()
                await response.aclose()
                raise AttemptFailed(backend.name, "http_5xx", f"answered {response.status_code}",
                                    response.status_code, raw, dict(response.headers))
            rest = response.aiter_raw()
            first = await anext(rest, b"")
            return Opened(response, first, rest)
    except TimeoutError as e:
        if response is not None:
            await response.aclose()
        raise AttemptFailed(backend.name, "timeout", f"no first byte within {first_byte_timeout_s:g} s") from e
    except httpx.TimeoutException as e:
        if response is not None:
            await response.aclose()
        raise AttemptFailed(backend.name, "timeout", type(e).__name__) from e
    except httpx.HTTPError as e:
        if response is not None:
            await response.aclose()
        raise AttemptFailed(backend.name, "connect_error", f"{type(e).__name__}: {e}") from e


async def fetch_capture(client: httpx.AsyncClient, backend: BackendConfig, path: str, headers: dict[str, str],
                        body: bytes, timeout_s: float, method: str = "POST") -> Capture:
    """One whole answer from `backend` as a Capture (a stream read to its end, events kept).

    Never raises for backend faults: a 5xx keeps its status and body, no answer gives status None
    and the reason in `error`.
    """
    start = time.perf_counter()
    try:
        opened = await open_attempt(client, backend, method, path, "", headers, body, timeout_s)
    except AttemptFailed as e:
        parsed = capture_body(e.status, e.body, start).body if e.status else None
        return Capture(status=e.status, body=parsed, error="" if e.status else str(e))
    try:
        if not opened.is_sse:
            raw = opened.first + b"".join([c async for c in opened.rest])
            return capture_body(opened.response.status_code, raw, start)
        tap = StreamTap(start, keep_events=True)
        tap.feed(opened.first)
        async for chunk in opened.rest:
            tap.feed(chunk)
        return tap.finish()
    except httpx.HTTPError as e:
        return Capture(status=opened.response.status_code, stream=opened.is_sse, error=f"broke: {e!r}")
    finally:
        await opened.response.aclose()


def sse_error_event(message: str, code: str = "backend_stream_broken") -> bytes:
    """The SSE error event the gateway sends when a stream breaks after its first byte."""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return f"data: {json.dumps(body)}\n\n".encode()


def error_json(status: int, message: str, code: str) -> dict[str, Any]:
    """An OpenAI error body from the gateway itself."""
    kind = {401: "authentication_error", 400: "invalid_request_error", 413: "invalid_request_error"}.get(
        status, "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
