"""The router's Prometheus series, per backend (label ``backend``: its URL or name).

- ``tandem_router:requests_total{backend}``: requests sent (each attempt of a retried one counts).
- ``tandem_router:errors_total{backend, kind}``: ``connect`` (never reached / no response),
  ``5xx``, ``timeout`` (no first byte within ``--first-byte-timeout``), ``ejected`` (a request
  waiting for its first byte when the backend was ejected), ``stream`` (broken after the first
  byte), ``probe`` (a failed active check).
- ``tandem_router:ejections_total{backend}``, ``tandem_router:retries_total`` (requests sent to a
  second backend after a failure), ``tandem_router:rejected_total{status}`` (the router's own
  400 / 429 / 502 / 503 answers; 400: a body nested too deeply to read).
- ``tandem_router:prompt_blocks_total{backend}`` / ``tandem_router:routed_hit_blocks_total{backend}``:
  prompt blocks routed there and how many of them its index held at dispatch; their ratio is the
  routed prefix hit rate, also exported as the gauge ``tandem_router:routed_prefix_hit_rate{backend}``.
- ``tandem_router:outstanding_requests{backend}``, ``tandem_router:backend_healthy{backend}`` (gauges).

Each router owns its ``CollectorRegistry`` (no global state).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from tandem.router.policy import BackendState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ERROR_KINDS = ("connect", "5xx", "timeout", "ejected", "stream", "probe")


class RouterMetrics:
    """The series of one router over ``backends`` (names fixed at start)."""

    def __init__(self, backends: Sequence[BackendState]) -> None:
        self.registry = reg = CollectorRegistry()
        self.backends = list(backends)
        b = ["backend"]
        self.requests = Counter("tandem_router:requests", "requests sent to a backend", b, registry=reg)
        self.errors = Counter("tandem_router:errors", "failed requests and probes", ["backend", "kind"], registry=reg)
        self.ejections = Counter("tandem_router:ejections", "times a backend was ejected", b, registry=reg)
        self.retries = Counter("tandem_router:retries", "requests retried on another backend", registry=reg)
        self.rejected = Counter("tandem_router:rejected", "requests the router answered itself", ["status"],
                                registry=reg)
        self.prompt_blocks = Counter("tandem_router:prompt_blocks", "prompt blocks routed to a backend", b,
                                     registry=reg)
        self.hit_blocks = Counter("tandem_router:routed_hit_blocks",
                                  "routed prompt blocks the backend's index held at dispatch", b, registry=reg)
        self.hit_rate = Gauge("tandem_router:routed_prefix_hit_rate", "routed_hit_blocks / prompt_blocks", b,
                              registry=reg)
        self.outstanding = Gauge("tandem_router:outstanding_requests", "requests in flight", b, registry=reg)
        self.healthy = Gauge("tandem_router:backend_healthy", "1 when routed to, 0 while ejected", b, registry=reg)
        self._blocks = {x.name: [0, 0] for x in self.backends}  # name -> [hit, prompt]
        for x in self.backends:
            for kind in ERROR_KINDS:
                self.errors.labels(x.name, kind)
            for series in (self.requests, self.ejections, self.prompt_blocks, self.hit_blocks):
                series.labels(x.name)
        for status in ("400", "429", "502", "503"):
            self.rejected.labels(status)

    def dispatched(self, backend: BackendState, prompt_blocks: int, hit_blocks: int) -> None:
        """Counts one request sent to ``backend`` with its routed hit."""
        self.requests.labels(backend.name).inc()
        self.prompt_blocks.labels(backend.name).inc(prompt_blocks)
        self.hit_blocks.labels(backend.name).inc(hit_blocks)
        counts = self._blocks[backend.name]
        counts[0] += hit_blocks
        counts[1] += prompt_blocks

    def hit_rate_of(self, name: str) -> float | None:
        """Routed prefix hit rate of one backend (None before any prompt block)."""
        hit, total = self._blocks[name]
        return hit / total if total else None

    def render(self) -> bytes:
        """The exposition text, with the gauges refreshed from the backends' states."""
        for x in self.backends:
            self.outstanding.labels(x.name).set(x.outstanding_requests)
            self.healthy.labels(x.name).set(1 if x.healthy else 0)
            rate = self.hit_rate_of(x.name)
            self.hit_rate.labels(x.name).set(rate if rate is not None else 0.0)
        return generate_latest(self.registry)
