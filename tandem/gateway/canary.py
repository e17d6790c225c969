"""Canary routing with promotion steps, and the gates that roll it back.

Routing: a client with a sticky key (the `sticky_header` value, else the body's `user`) is placed
at u = SHA-256(key) / 2^256 in [0, 1) and goes to the candidate while u < weight, so raising the
weight only moves clients from primary to candidate, never back and forth (the consistent split of
Flagger / Argo Rollouts header routing). Without a key u is drawn at random per request.

Gates (Flagger's metric checks, Kayenta's primary-vs-candidate comparison): over a sliding window of
`window_s` seconds, see `GateConfig`. A failed gate sets the weight to 0 at once and for good (a
rollback is not undone automatically), logs why, and is shown in /metrics and /gateway/status.
Promotion: with steps, each step holds for `hold_s` seconds while the gates pass, then the next
step's weight applies once the gates had something to judge in the step (`min_requests` candidate
requests or `min_comparisons` shadow comparisons; with the gates off the hold alone); after the last
step the weight stays.
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tandem.gateway.config import CANDIDATE, PRIMARY, CanaryConfig, GateConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """One client request's result on one backend. ttft_s / tpot_s: None when not measured (an
    error, a non-streamed answer for TPOT, or one output token)."""

    at: float
    backend: str
    ok: bool
    ttft_s: float | None = None
    tpot_s: float | None = None


def sticky_point(key: str) -> float:
    """The client's fixed place in [0, 1): SHA-256 of the key as a 256-bit fraction."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest(), "big") / 2.0**256


def _p95(values: list[float]) -> float | None:
    return float(np.percentile(values, 95)) if values else None


class CanaryController:
    """Holds the candidate's weight and decides each request's backend.

    State: `weight`, `step_index`, `rolled_back` / `rollback_reason`, the outcome and comparison
    windows. Changed by `record`, `record_comparison` and `evaluate` (called by both).
    """

    def __init__(self, canary: CanaryConfig, gates: GateConfig, has_candidate: bool,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        self.config, self.gates = canary, gates
        self.has_candidate = has_candidate
        self._clock = clock
        self._rng = rng or random.Random()
        self.step_index = 0 if canary.steps else -1
        self.weight = canary.steps[0].weight if canary.steps else canary.weight
        self.step_started = clock()
        self.rolled_back = False
        self.rollback_reason = ""
        self.rollback_at: float | None = None
        self.promotions = 0
        self.outcomes: deque[Outcome] = deque()
        self.comparisons: deque[tuple[float, bool]] = deque()

    def choose(self, sticky_key: str | None) -> str:
        """PRIMARY or CANDIDATE for one request (reads state only)."""
        if not self.has_candidate or self.weight <= 0.0:
            return PRIMARY
        u = sticky_point(sticky_key) if sticky_key else self._rng.random()
        return CANDIDATE if u < self.weight else PRIMARY

    def record(self, outcome: Outcome) -> None:
        """Adds one outcome to the window, then re-evaluates the gates and the promotion."""
        self.outcomes.append(outcome)
        self.evaluate()

    def record_comparison(self, diverged: bool) -> None:
        """Adds one shadow comparison (True: the answers diverged), then re-evaluates."""
        self.comparisons.append((self._clock(), diverged))
        self.evaluate()

    def _trim(self, now: float) -> None:
        for q, at in ((self.outcomes, lambda o: o.at), (self.comparisons, lambda c: c[0])):
            while q and now - at(q[0]) > self.gates.window_s:
                q.popleft()

    def window_stats(self) -> dict[str, dict]:
        """Per backend over the window: requests, errors, error_rate, p95 TTFT and TPOT (s)."""
        self._trim(self._clock())
        stats = {}
        for name in (PRIMARY, CANDIDATE):
            mine = [o for o in self.outcomes if o.backend == name]
            errors = sum(not o.ok for o in mine)
            ttfts = [o.ttft_s for o in mine if o.ok and o.ttft_s is not None]
            tpots = [o.tpot_s for o in mine if o.ok and o.tpot_s is not None]
            stats[name] = {
                "requests": len(mine), "errors": errors, "error_rate": errors / len(mine) if mine else None,
                "p95_ttft_s": _p95(ttfts), "p95_tpot_s": _p95(tpots),
                "ttft_samples": len(ttfts), "tpot_samples": len(tpots),
            }
        n = len(self.comparisons)
        diverged = sum(d for _, d in self.comparisons)
        stats["shadow"] = {"comparisons": n, "diverged": diverged, "divergence_rate": diverged / n if n else None}
        return stats

    def failed_gate(self, stats: dict[str, dict]) -> str | None:
        """The first failing gate's reason, or None (pure function of `stats`)."""
        g, cand, prim = self.gates, stats[CANDIDATE], stats[PRIMARY]
        if cand["requests"] >= g.min_requests:
            if cand["error_rate"] > g.max_error_rate:
                return f"candidate error rate {cand['error_rate']:.1%} > {g.max_error_rate:.1%} " \
                       f"({cand['errors']}/{cand['requests']} in {g.window_s:g} s)"
            for key, label in (("ttft", "p95 TTFT"), ("tpot", "p95 TPOT")):
                c, p = cand[f"p95_{key}_s"], prim[f"p95_{key}_s"]
                enough = min(cand[f"{key}_samples"], prim[f"{key}_samples"]) >= g.min_latency_samples
                if enough and p > 0 and c > g.max_latency_ratio * p:
                    return f"candidate {label} {c * 1000:.1f} ms > {g.max_latency_ratio:g} x primary {p * 1000:.1f} ms"
        shadow = stats["shadow"]
        if shadow["comparisons"] >= g.min_comparisons and shadow["divergence_rate"] > g.max_divergence_rate:
            return f"shadow divergence rate {shadow['divergence_rate']:.1%} > {g.max_divergence_rate:.1%} " \
                   f"({shadow['diverged']}/{shadow['comparisons']})"
        return None

    def evaluate(self) -> None:
        """Rolls back on a failed gate (weight 0, logged), else promotes a step whose hold is over
        (with the gates disabled steps promote on their holds alone)."""
        if self.rolled_back or not self.has_candidate:
            return
        reason = self.failed_gate(self.window_stats()) if self.gates.enabled else None
        if reason is not None:
            self.rolled_back, self.rollback_reason, self.rollback_at = True, reason, self._clock()
            logger.warning("gateway: rollback to primary (candidate weight %.3f -> 0): %s", self.weight, reason)
            self.weight = 0.0
            return
        steps = self.config.steps
        i = self.step_index
        held = 0 <= i < len(steps) - 1 and self._clock() - self.step_started >= steps[i].hold_s
        if held and (not self.gates.enabled or self._step_judged()):
            self.step_index += 1
            self.step_started = self._clock()
            self.weight = steps[self.step_index].weight
            self.promotions += 1
            logger.warning("gateway: promoted to canary step %d (candidate weight %.3f)", self.step_index, self.weight)

    def _step_judged(self) -> bool:
        """True once the gates have had something to judge during this step: `min_requests`
        candidate requests, or `min_comparisons` shadow comparisons (a weight-0 step that only
        shadows), in the window since the step began. A hold that passes without traffic is no
        evidence, so it does not promote (Flagger halts an analysis that finds no metrics)."""
        since = self.step_started
        served = sum(o.backend == CANDIDATE and o.at >= since for o in self.outcomes)
        compared = sum(at >= since for at, _ in self.comparisons)
        return served >= self.gates.min_requests or compared >= self.gates.min_comparisons

    def snapshot(self) -> dict:
        """Weights, steps, rollback and the window's gate figures, as JSON-ready values."""
        steps = self.config.steps
        return {
            "weights": {PRIMARY: round(1.0 - self.weight, 6), CANDIDATE: round(self.weight, 6)},
            "step": self.step_index, "steps": [{"weight": s.weight, "hold_s": s.hold_s} for s in steps],
            "promotions": self.promotions, "rolled_back": self.rolled_back,
            "rollback_reason": self.rollback_reason, "window": self.window_stats(),
            "gates": {"window_s": self.gates.window_s, "min_requests": self.gates.min_requests,
                      "max_error_rate": self.gates.max_error_rate,
                      "max_latency_ratio": self.gates.max_latency_ratio,
                      "min_latency_samples": self.gates.min_latency_samples,
                      "max_divergence_rate": self.gates.max_divergence_rate, "enabled": self.gates.enabled},
        }
