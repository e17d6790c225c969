"""Prometheus series of one gateway, on a registry of its own (no process-global state).

Names start with `tandem_gateway_`; `backend` is `primary` or `candidate`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    """The gateway's counters and gauges; `render()` is the /metrics body."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("tandem_gateway_requests", "client requests by the backend that answered and "
                                "outcome (ok, error: an error status or broken stream, unavailable: no backend)",
                                ["backend", "outcome"], registry=r)
        self.attempt_failures = Counter("tandem_gateway_attempt_failures", "backend attempts that failed before "
                                        "the first byte (connect error, 5xx, timeout)", ["backend", "reason"],
                                        registry=r)
        self.fallbacks = Counter("tandem_gateway_fallbacks", "requests answered by another backend than the "
                                 "one chosen first", ["from_backend", "to_backend"], registry=r)
        self.midstream_failures = Counter("tandem_gateway_midstream_failures", "streams that broke after the "
                                          "first byte (ended with an error event and [DONE])", ["backend"], registry=r)
        self.retry_budget_exhausted = Counter("tandem_gateway_retry_budget_exhausted",
                                              "fallbacks refused by the retry budget", registry=r)
        self.usage_tokens = Counter("tandem_gateway_usage_tokens", "usage of client requests (shadow legs "
                                    "excluded), counted once per client request", ["kind"], registry=r)
        self.ttft = Histogram("tandem_gateway_time_to_first_token_seconds", "TTFT seen by the gateway",
                              ["backend"], buckets=_LATENCY_BUCKETS, registry=r)
        self.canary_weight = Gauge("tandem_gateway_canary_weight", "share of requests sent to the candidate",
                                   registry=r)
        self.rolled_back = Gauge("tandem_gateway_rolled_back", "1 after a failed gate rolled the canary back",
                                 registry=r)
        self.rollbacks = Counter("tandem_gateway_rollbacks", "automatic rollbacks", registry=r)
        self.promotions = Counter("tandem_gateway_promotions", "canary steps promoted", registry=r)
        self.breaker_state = Gauge("tandem_gateway_breaker_state", "0 closed, 1 half-open, 2 open", ["backend"],
                                   registry=r)
        self.breaker_opened = Counter("tandem_gateway_breaker_opened", "times a breaker opened", ["backend"],
                                      registry=r)
        self.shadow = Counter("tandem_gateway_shadow_requests", "shadow legs by result (started, compared, "
                              "diverged, dropped: concurrency bound reached, failed: the leg raised, skipped: the "
                              "primary did not answer)", ["result"], registry=r)
        self.shadow_divergences = Counter("tandem_gateway_shadow_divergences", "shadow comparisons that diverged",
                                          ["tier"], registry=r)
        self.shadow_in_flight = Gauge("tandem_gateway_shadow_in_flight", "shadow legs running", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
