"""Per-backend circuit breaker and the gateway-wide retry budget.

Breaker (Nygard, "Release It!", ch. 5; the states of Hystrix / Envoy outlier ejection): `closed`
counts consecutive failures; `failures` of them open it; after `cooldown_s` it is `half_open` and
lets exactly one request through as the probe; the probe's success closes it, its failure opens it
again for another cooldown.

Retry budget (Finagle's RetryBudget, Envoy's retry_budget): over the last `window_s` seconds,
retries may be at most max(min_retries, ratio x requests), so a failing backend cannot multiply
the load on the others.

Both take an injectable monotonic clock (`clock() -> seconds`) so tests can move time.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_CODES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}


class CircuitBreaker:
    """One backend's breaker. State changes only in `allow`, `record_success`, `record_failure`."""

    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.failures_to_open = failures
        self.cooldown_s = cooldown_s
        self._clock = clock
        self.state = CLOSED
        self.consecutive_failures = 0
        self.opened_at = 0.0
        self.probe_in_flight = False
        self.times_opened = 0

    def allow(self) -> bool:
        """True when a request may go to this backend now. In `open` past the cooldown it moves to
        `half_open` and admits this one request as the probe (later calls get False until the probe
        ends)."""
        if self.state == CLOSED:
            return True
        if self.state == OPEN and self._clock() - self.opened_at >= self.cooldown_s:
            self.state = HALF_OPEN
            self.probe_in_flight = False
        if self.state == HALF_OPEN and not self.probe_in_flight:
            self.probe_in_flight = True
            return True
        return False

    def record_success(self) -> None:
        """A request succeeded: the breaker closes and the failure count restarts."""
        self.state, self.consecutive_failures, self.probe_in_flight = CLOSED, 0, False

    def record_failure(self) -> None:
        """A request failed: a failed probe, or the `failures`-th failure in a row, opens it."""
        self.consecutive_failures += 1
        if self.state == HALF_OPEN or (self.state == CLOSED and self.consecutive_failures >= self.failures_to_open):
            self.state, self.opened_at, self.probe_in_flight = OPEN, self._clock(), False
            self.times_opened += 1

    def retry_after_s(self) -> float:
        """Seconds until an open breaker lets a probe through (0 when not open)."""
        if self.state != OPEN:
            return 0.0
        return max(0.0, self.cooldown_s - (self._clock() - self.opened_at))

    def snapshot(self) -> dict:
        return {"state": self.state, "consecutive_failures": self.consecutive_failures,
                "times_opened": self.times_opened, "retry_after_s": round(self.retry_after_s(), 3)}


class RetryBudget:
    """Counts requests and retries in a sliding window; `try_spend` admits a retry within budget."""

    def __init__(self, ratio: float, min_retries: int, window_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ratio, self.min_retries, self.window_s = ratio, min_retries, window_s
        self._clock = clock
        self._requests: deque[float] = deque()
        self._retries: deque[float] = deque()
        self.exhausted = 0

    def _trim(self, now: float) -> None:
        for q in (self._requests, self._retries):
            while q and now - q[0] > self.window_s:
                q.popleft()

    def record_request(self) -> None:
        """One client request arrived (adds to the window)."""
        self._requests.append(self._clock())

    def try_spend(self) -> bool:
        """True (and one retry recorded) when a retry fits the budget; else counts an exhaustion."""
        now = self._clock()
        self._trim(now)
        if len(self._retries) < max(self.min_retries, self.ratio * len(self._requests)):
            self._retries.append(now)
            return True
        self.exhausted += 1
        return False
