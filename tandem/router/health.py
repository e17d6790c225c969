"""Backend health: passive failures and active ``/health`` checks eject a backend; it is probed
half-open before it is trusted again. A state machine on an injectable clock; no I/O.

States (``HealthState``), as in a circuit breaker (Envoy's outlier detection, Nygard's *Release It!*):

- ``HEALTHY``: routed normally. A connect error (refused, reset, timeout before the response) or a
  failed active check ejects it at once; passive failures (a ``5xx`` answer, no response byte within
  the router's first-byte timeout) eject it after ``failure_threshold`` in a row (one successful
  request resets the count; a passing ``/health`` check does not: a server whose ``/health`` answers
  while its requests hang must still reach the threshold).
- ``EJECTED``: not routed (``BackendState.healthy`` False) for ``backoff`` seconds, which starts at
  ``eject_s`` and doubles with every ejection that follows a half-open failure (at most
  ``max_eject_s``). When it has passed, ``due_probe`` is True and the active checker probes ``/health``.
- ``HALF_OPEN``: the probe passed; the backend takes one request at a time
  (``BackendState.probation``). A success (a trial request, or the next passing probe while no trial
  is in flight) makes it ``HEALTHY`` and resets the backoff; any failure ejects it again with a
  doubled backoff.

An ejection is *silent* (``silent``, the default) when the backend stopped answering: a timed-out
``/health`` probe or connect, first-byte timeouts (a SIGSTOPped or hung server). The router then cuts short
the requests still waiting there for their first byte and retries them elsewhere. An ejection for a refusal
(connection refused, an error status) is not silent: the requests it accepted before keep waiting, since a
server that drains (SIGTERM: it stops listening and finishes what it has) answers them, and a dead one
breaks their connections, which retries them anyway (``last_silent``).

``BackendHealth`` changes the ``BackendState`` it was given (``healthy``, ``probation``) and counts
``ejections``; every method says what it changes.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable

from tandem.router.policy import BackendState

logger = logging.getLogger(__name__)


class HealthState(enum.Enum):
    HEALTHY = "healthy"
    EJECTED = "ejected"
    HALF_OPEN = "half_open"


class BackendHealth:
    """One backend's health state machine.

    Args:
        backend: its routing state (``healthy`` and ``probation`` are set from here).
        failure_threshold: consecutive passive failures (5xx, first-byte timeouts) that eject it (>= 1).
        eject_s / max_eject_s: the first and the largest ejection time in seconds.
        clock: monotonic seconds.
        on_eject: called with the reason at each ejection (the router counts them in /metrics).

    Raises:
        ValueError: ``failure_threshold < 1`` or ejection times not ``0 < eject_s <= max_eject_s``.
    """

    def __init__(self, backend: BackendState, failure_threshold: int = 3, eject_s: float = 2.0,
                 max_eject_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 on_eject: Callable[[str], None] | None = None) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        if not 0 < eject_s <= max_eject_s:
            raise ValueError(f"need 0 < eject_s <= max_eject_s, got {eject_s} and {max_eject_s}")
        self.backend = backend
        self.failure_threshold = failure_threshold
        self.eject_s = eject_s
        self.max_eject_s = max_eject_s
        self._clock = clock
        self._on_eject = on_eject
        self.state = HealthState.HEALTHY
        self.consecutive_failures = 0
        self.ejections = 0
        self.backoff_s = eject_s
        self.ejected_until = 0.0
        self.last_error: str | None = None
        self.last_silent = False  # the last ejection was for silence (see the module doc)

    def _set(self, state: HealthState) -> None:
        self.state = state
        self.backend.healthy = state is not HealthState.EJECTED
        self.backend.probation = state is HealthState.HALF_OPEN

    def eject(self, reason: str, silent: bool = True) -> None:
        """Stops routing to the backend for ``backoff_s`` seconds (doubled after a half-open failure,
        and after a failed probe of an ejected backend whose time was up: that one is not counted as
        a new ejection). A failure reported while the backend is ejected and not yet due changes only
        ``last_error``. ``silent``: the backend stopped answering (see the module doc), set as
        ``last_silent`` before ``on_eject`` runs.

        Changes: state, ``ejections``, ``backoff_s``, ``ejected_until``, ``last_error``, ``last_silent``,
        ``backend.healthy``.
        """
        if self.state is HealthState.EJECTED:
            self.last_error = reason
            if self.due_probe:  # its probe failed once its time was up: eject again, for longer
                self.backoff_s = min(self.backoff_s * 2, self.max_eject_s)
                self.ejected_until = self._clock() + self.backoff_s
                logger.warning("backend %s still failing, ejected for %.1f s: %s", self.backend.name,
                               self.backoff_s, reason)
            return
        if self.state is HealthState.HALF_OPEN:
            self.backoff_s = min(self.backoff_s * 2, self.max_eject_s)
        self.ejections += 1
        self.last_error = reason
        self.last_silent = silent
        self.ejected_until = self._clock() + self.backoff_s
        self.consecutive_failures = 0
        logger.warning("backend %s ejected for %.1f s: %s", self.backend.name, self.backoff_s, reason)
        self._set(HealthState.EJECTED)
        if self._on_eject is not None:
            self._on_eject(reason)

    def on_connect_error(self, reason: str, silent: bool = True) -> None:
        """A request or probe could not reach the backend (``silent``: it timed out, else it was refused or
        broken): ejects it. Changes: see ``eject``."""
        self.eject(reason, silent)

    def on_response(self, status: int) -> None:
        """A response's status: 5xx is a passive failure (``on_failure``); anything else is a success (a
        4xx is the client's doing, a 429 the backend's load: both show it alive). Changes: see ``on_failure``."""
        if status >= 500:
            self.on_failure(f"answered {status}", silent=False)
            return
        self.on_success()

    def on_failure(self, reason: str, silent: bool = True) -> None:
        """A passive failure (a 5xx answer: not ``silent``; no first byte in time): ejects the backend at the
        ``failure_threshold``-th in a row, or at once when half-open. Changes: the failure count, state."""
        self.consecutive_failures += 1
        if self.state is HealthState.HALF_OPEN or self.consecutive_failures >= self.failure_threshold:
            self.eject(f"{self.consecutive_failures} consecutive failures, the last: {reason}", silent)

    def on_success(self) -> None:
        """The backend answered well: a half-open backend becomes healthy. Changes: state, backoff, 5xx count."""
        self.consecutive_failures = 0
        if self.state is HealthState.HALF_OPEN:
            logger.info("backend %s is healthy again", self.backend.name)
            self.backoff_s = self.eject_s
            self._set(HealthState.HEALTHY)

    @property
    def due_probe(self) -> bool:
        """True when an ejected backend's time is up and the active checker should probe it."""
        return self.state is HealthState.EJECTED and self._clock() >= self.ejected_until

    def on_probe(self, ok: bool, reason: str = "", silent: bool = True) -> None:
        """The result of an active ``/health`` check. An ejected backend whose time is up goes half-open
        on success; a half-open one with no trial request in flight becomes healthy (with one in flight,
        the trial decides); a healthy one keeps its failure count (NOTE: only a request's success clears
        it: ``/health`` may pass while every request hangs); a failure ejects (``silent``: the probe timed
        out). Changes: state (see above)."""
        if not ok:
            self.eject(reason or "health check failed", silent)
        elif self.state is HealthState.EJECTED:
            if self.due_probe:
                logger.info("backend %s passed its probe: half-open", self.backend.name)
                self._set(HealthState.HALF_OPEN)
        elif self.state is HealthState.HALF_OPEN and self.backend.outstanding_requests == 0:
            self.on_success()

    def describe(self) -> dict[str, object]:
        """The JSON-ready state for ``GET /backends``. No state changes."""
        left = max(0.0, self.ejected_until - self._clock()) if self.state is HealthState.EJECTED else 0.0
        return {"state": self.state.value, "ejections": self.ejections,
                "consecutive_failures": self.consecutive_failures, "ejected_for_s": round(left, 3),
                "last_error": self.last_error}
