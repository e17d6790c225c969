"""Shadow legs: a sampled share of primary-served requests is also sent to the candidate.

Fire-and-forget: the leg is an asyncio task the client's request never awaits; at most
`max_concurrency` legs run at once and a sample beyond that is dropped (counted), never queued, so
shadowing cannot delay the primary. The leg carries `x-tandem-shadow: 1`, goes around the breakers,
fallback and usage totals, and once the primary's answer is known the two are compared
(`compare.compare_answers`) and discarded. What is kept of a divergence: SHA-256 hashes and lengths
of the request and of both texts, the differing tiers; redacted samples only with `keep_samples`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from tandem.gateway.answer import answer_of
from tandem.gateway.capture import Capture
from tandem.gateway.compare import compare_answers
from tandem.gateway.config import ShadowConfig

logger = logging.getLogger(__name__)
_EMAIL = re.compile(r"[\w.+-]+@[\w-]+\.[\w.-]+")
_DIGITS = re.compile(r"\d{3,}")


def redact(text: str, limit: int = 200) -> str:
    """A sample safe to keep: e-mail addresses and runs of 3+ digits masked, cut to `limit` chars."""
    return _DIGITS.sub("<num>", _EMAIL.sub("<email>", text))[:limit]


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _prompt_text(request: dict[str, Any]) -> str:
    if "messages" in request:
        return "\n".join(str(m.get("content", "")) for m in request["messages"] if isinstance(m, dict))
    return str(request.get("prompt", ""))


class ShadowRunner:
    """Starts and tracks shadow legs. State: `in_flight`, counters, `recent` divergences (last 50).

    fetch(request_body_dict, raw_body, path, headers) -> Capture sends one leg to the candidate;
    on_compared(diverged, tiers) is told each comparison's result, on_count(name) each change of
    a counter (started, dropped, compared, diverged, failed, skipped).
    """

    def __init__(self, config: ShadowConfig, fetch: Callable[..., Awaitable[Capture]],
                 on_compared: Callable[[bool, set[str]], None], on_count: Callable[[str], None] = lambda _: None,
                 rng: random.Random | None = None) -> None:
        self.config = config
        self._fetch, self._on_compared, self._on_count = fetch, on_compared, on_count
        self._rng = rng or random.Random()
        self.tasks: set[asyncio.Task] = set()
        self.in_flight = 0
        self.counts = {"started": 0, "dropped": 0, "compared": 0, "diverged": 0, "failed": 0, "skipped": 0}
        self.recent: deque[dict[str, Any]] = deque(maxlen=50)

    def _count(self, name: str) -> None:
        self.counts[name] += 1
        self._on_count(name)

    def maybe_launch(self, request: dict[str, Any], raw: bytes, path: str,
                     headers: dict[str, str]) -> asyncio.Future | None:
        """Samples this request; when taken, starts its leg and returns the future the caller must
        resolve with the primary's Capture (or None when the primary did not answer it)."""
        if self.config.fraction <= 0 or self._rng.random() >= self.config.fraction:
            return None
        if self.in_flight >= self.config.max_concurrency:
            self._count("dropped")
            return None
        primary: asyncio.Future = asyncio.get_running_loop().create_future()
        self.in_flight += 1
        self._count("started")
        task = asyncio.create_task(self._run(primary, request, raw, path, headers))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return primary

    async def _run(self, primary: asyncio.Future, request: dict[str, Any], raw: bytes, path: str,
                   headers: dict[str, str]) -> None:
        try:
            async with asyncio.timeout(self.config.timeout_s):
                candidate = await self._fetch(request, raw, path, headers)
                answer = await primary
            if answer is None:
                self._count("skipped")
                return
            self._compare(request, answer, candidate)
        except Exception as e:  # NOTE: a leg must never disturb the gateway; it is counted and logged
            self._count("failed")
            logger.info("gateway: shadow leg failed: %r", e)
        finally:
            self.in_flight -= 1

    def _compare(self, request: dict[str, Any], primary: Capture, candidate: Capture) -> None:
        comparison = compare_answers(request, primary, candidate)
        self._count("compared")
        if comparison.diverged:
            self._count("diverged")
            self.recent.append(self._record(request, primary, candidate, comparison))
        self._on_compared(comparison.diverged, comparison.tiers)

    def _record(self, request: dict[str, Any], primary: Capture, candidate: Capture, comparison) -> dict[str, Any]:
        texts = ["".join(a.texts) for a in (answer_of(primary), answer_of(candidate))]
        prompt = _prompt_text(request)
        record: dict[str, Any] = {
            "at": time.time(), "request_sha256": digest(prompt), "request_chars": len(prompt),
            "primary": {"status": primary.status, "sha256": digest(texts[0]), "chars": len(texts[0])},
            "candidate": {"status": candidate.status, "sha256": digest(texts[1]), "chars": len(texts[1])},
            "tiers": sorted(comparison.tiers), "details": [d.detail for d in comparison.diffs][:5],
        }
        if self.config.keep_samples:
            record["sample"] = {"request": redact(prompt), "primary": redact(texts[0]), "candidate": redact(texts[1])}
        return record

    async def close(self) -> None:
        """Cancels the legs still running and waits for them."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def snapshot(self) -> dict[str, Any]:
        return {"fraction": self.config.fraction, "max_concurrency": self.config.max_concurrency,
                "in_flight": self.in_flight, **self.counts, "recent_divergences": list(self.recent)[-10:]}
