"""What one backend answered, seen while the bytes pass through unchanged.

`StreamTap` reads a Server-Sent Events body as it is forwarded (the bytes themselves are not
altered), noting the time of the first content chunk (TTFT, as `tandem/bench/client.py` defines
it: a chat chunk holding only the role header is not a token), the usage chunk, `[DONE]`, and,
when asked to keep them, the parsed events for the comparator. `Capture` is the result, also built
from a non-streamed JSON answer.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Capture:
    """One answer. status: HTTP status (None: no response, `error` says why); body: the parsed JSON
    of a non-streamed answer or error; events: the SSE data objects of a stream (kept only when
    asked); done: `data: [DONE]` was seen; chunks: SSE data events that carried choices; ttft_s /
    latency_s: from the request's start to the first content chunk / the end (seconds; ttft_s is
    None for a non-streamed answer)."""

    status: int | None = None
    stream: bool = False
    body: Any = None
    events: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    chunks: int = 0
    content_chunks: int = 0
    usage: dict[str, Any] | None = None
    error: str = ""
    ttft_s: float | None = None
    latency_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    def tpot_s(self) -> float | None:
        """(latency - TTFT) / (output tokens - 1), tokens from usage else content chunks; None for
        one token or no stream."""
        if not self.stream or self.ttft_s is None or self.latency_s is None:
            return None
        n = (self.usage or {}).get("completion_tokens") or self.content_chunks
        return (self.latency_s - self.ttft_s) / (n - 1) if n and n > 1 else None


def _is_content(choice: dict[str, Any]) -> bool:
    if "text" in choice:
        return True
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")) \
        or choice.get("finish_reason") is not None


class StreamTap:
    """Feed it the forwarded bytes in order (`feed`), then `finish`; it fills `capture`."""

    def __init__(self, start: float, keep_events: bool) -> None:
        self.capture = Capture(stream=True, status=200)
        self.start = start
        self.keep_events = keep_events
        self._pending = b""

    def feed(self, chunk: bytes) -> None:
        """Parses every complete line in `chunk` (plus what was left over before)."""
        self._pending += chunk
        *lines, self._pending = self._pending.split(b"\n")
        for line in lines:
            self._line(line.strip())

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if data == b"[DONE]":
            self.capture.done = True
            return
        try:
            event = json.loads(data)
        except ValueError:
            self.capture.error = self.capture.error or f"malformed SSE data: {data[:80]!r}"
            return
        if not isinstance(event, dict):
            return
        if self.keep_events:
            self.capture.events.append(event)
        choices = event.get("choices") or []
        if choices:
            self.capture.chunks += 1
            if any(_is_content(c) for c in choices if isinstance(c, dict)):
                self.capture.content_chunks += 1
                if self.capture.ttft_s is None:
                    self.capture.ttft_s = time.perf_counter() - self.start
        if event.get("usage"):
            self.capture.usage = event["usage"]
        if "error" in event and not choices:
            self.capture.error = self.capture.error or json.dumps(event["error"])[:300]

    def finish(self, error: str = "") -> Capture:
        """Ends the capture (a leftover line is parsed); `error`: why the stream broke, if it did."""
        if self._pending:
            self._line(self._pending.strip())
            self._pending = b""
        self.capture.latency_s = time.perf_counter() - self.start
        if error:
            self.capture.error = error
        elif not self.capture.done and not self.capture.error:
            self.capture.error = "stream ended before [DONE]"
        return self.capture


def capture_body(status: int, raw: bytes, start: float) -> Capture:
    """A Capture of a whole (non-streamed) answer; a body that is not JSON is kept as text. Its
    ttft_s stays None: the first token's time is not seen, and the whole latency is not a TTFT."""
    try:
        body: Any = json.loads(raw) if raw else None
    except ValueError:
        body = raw.decode("utf-8", "replace")
    usage = body.get("usage") if isinstance(body, dict) else None
    elapsed = time.perf_counter() - start
    return Capture(status=status, body=body, usage=usage if isinstance(usage, dict) else None,
                   latency_s=elapsed)
