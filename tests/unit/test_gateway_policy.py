"""Gateway policies without a network: breaker states, retry budget, canary split, steps, gates, config."""

from __future__ import annotations

import random

import pytest

from tandem.gateway.canary import CanaryController, Outcome, sticky_point
from tandem.gateway.config import CanaryConfig, CanaryStep, GateConfig, config_from_mapping
from tandem.gateway.health import CircuitBreaker, RetryBudget
from tandem.gateway.shadow import redact


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_cools_down_and_probes_once():
    clock = Clock()
    b = CircuitBreaker(failures=2, cooldown_s=5, clock=clock)
    b.record_failure()
    assert b.state == "closed" and b.allow()
    b.record_failure()
    assert b.state == "open" and not b.allow() and b.retry_after_s() == 5
    clock.now = 5
    assert b.allow() and b.state == "half_open"
    assert not b.allow()  # one probe at a time
    b.record_failure()
    assert b.state == "open" and b.times_opened == 2
    clock.now = 10
    assert b.allow()
    b.record_success()
    assert b.state == "closed" and b.consecutive_failures == 0 and b.allow()


def test_retry_budget_is_a_share_of_recent_requests():
    clock = Clock()
    budget = RetryBudget(ratio=0.5, min_retries=1, window_s=10, clock=clock)
    for _ in range(4):
        budget.record_request()
    assert [budget.try_spend() for _ in range(3)] == [True, True, False]
    assert budget.exhausted == 1
    clock.now = 11  # the window moved on: only the minimum is left
    assert budget.try_spend() and not budget.try_spend()


def test_sticky_split_is_monotone_in_the_weight():
    keys = [f"user-{i}" for i in range(2000)]
    low = {k for k in keys if sticky_point(k) < 0.1}
    high = {k for k in keys if sticky_point(k) < 0.3}
    assert low <= high  # raising the weight only moves clients to the candidate
    assert 0.25 < len(high) / len(keys) < 0.35
    c = CanaryController(CanaryConfig(weight=0.3), GateConfig(), True, rng=random.Random(0))
    assert all(c.choose(k) == ("candidate" if k in high else "primary") for k in keys[:200])


def test_steps_promote_after_their_hold_and_gates_roll_back():
    clock = Clock()
    canary = CanaryConfig(steps=(CanaryStep(0.1, 10), CanaryStep(0.5, 10), CanaryStep(1.0, 0)))
    gates = GateConfig(window_s=30, min_requests=3, max_error_rate=0.3)
    c = CanaryController(canary, gates, True, clock)
    assert c.weight == 0.1
    for t in (4, 6):
        c.record(Outcome(t, "candidate", True, 0.01, 0.01))
    clock.now = 10  # the hold is over and the step saw min_requests candidate requests
    c.record(Outcome(10, "candidate", True, 0.01, 0.01))
    assert (c.step_index, c.weight, c.promotions) == (1, 0.5, 1)
    for t in (11, 12):
        c.record(Outcome(t, "candidate", False))
    assert c.rolled_back and c.weight == 0.0 and "error rate 40.0% > 30.0%" in c.rollback_reason
    clock.now = 100
    c.record(Outcome(100, "candidate", True))
    assert c.weight == 0.0 and c.choose("anyone") == "primary"  # a rollback is final


def test_latency_and_divergence_gates():
    clock = Clock()
    gates = GateConfig(min_requests=2, max_latency_ratio=2.0, min_comparisons=2, max_divergence_rate=0.4,
                       min_latency_samples=2)
    c = CanaryController(CanaryConfig(weight=0.5), gates, True, clock)
    for ttft in (0.010, 0.012):
        c.record(Outcome(0, "primary", True, ttft, 0.005))
    c.record(Outcome(0, "candidate", True, 0.015, 0.005))
    c.record(Outcome(0, "candidate", True, 0.030, 0.005))
    assert c.rolled_back and c.rollback_reason.startswith("candidate p95 TTFT 29.2 ms > 2 x primary 11.9 ms")
    d = CanaryController(CanaryConfig(weight=0.5), gates, True, clock)
    d.record_comparison(False)
    d.record_comparison(True)
    assert d.rolled_back and "shadow divergence rate 50.0% > 40.0% (1/2)" in d.rollback_reason


def test_config_from_mapping_and_its_errors():
    cfg = config_from_mapping({
        "primary": {"url": "http://a:1/v1", "api_key": "k", "model_map": {"m": "m2"}}, "candidate": "http://b:2",
        "canary": {"weight": 0.2, "steps": [{"weight": 0.2, "hold_s": 60}]}, "shadow": {"fraction": 0.1}})
    assert cfg.primary.url == "http://a:1" and cfg.primary.model_map == {"m": "m2"}
    assert cfg.canary.steps == (CanaryStep(0.2, 60),) and cfg.shadow.fraction == 0.1
    with pytest.raises(ValueError, match=r"unknown keys \['wieght'\]"):
        config_from_mapping({"primary": "http://a", "canary": {"wieght": 1}})
    with pytest.raises(ValueError, match="need a --candidate"):
        config_from_mapping({"primary": "http://a", "shadow": {"fraction": 0.5}})
    with pytest.raises(ValueError, match=r"canary weight must be in \[0, 1\]"):
        config_from_mapping({"primary": "http://a", "candidate": "http://b", "canary": {"weight": 2}})
    with pytest.raises(ValueError, match="a primary backend is required"):
        config_from_mapping({})


def test_redacted_samples_mask_emails_and_numbers():
    assert redact("mail bob@example.com card 4111111111111111 ok 12") == "mail <email> card <num> ok 12"


def test_cli_flags_override_the_yaml_file(tmp_path):
    from tandem.cli import build_parser
    from tandem.gateway.cli import gateway_config_from_args

    path = tmp_path / "gateway.yaml"
    path.write_text("primary: {url: 'http://a:1', api_key: pk}\ncandidate: 'http://b:2'\n"
                    "canary: {weight: 0.1}\ngates: {window_s: 30}\n")
    args = build_parser().parse_args(["gateway", "--config", str(path), "--canary-weight", "0.3",
                                      "--candidate-model-map", "m=m-next", "--canary-steps", "0.3:60,1:0"])
    cfg = gateway_config_from_args(args)
    assert cfg.primary.api_key == "pk" and cfg.candidate.url == "http://b:2"
    assert cfg.candidate.model_map == {"m": "m-next"} and cfg.gates.window_s == 30
    assert cfg.canary.weight == 0.3 and cfg.canary.steps == (CanaryStep(0.3, 60), CanaryStep(1.0, 0))
    bad = build_parser().parse_args(["gateway", "--primary", "http://a", "--candidate-model-map", "oops"])
    with pytest.raises(ValueError, match="CLIENT_NAME=BACKEND_NAME"):
        gateway_config_from_args(bad)


def test_every_gate_shadow_and_fallback_setting_has_a_flag(tmp_path):
    import dataclasses

    from tandem.cli import build_parser
    from tandem.gateway.cli import SECTION_FLAGS, gateway_config_from_args
    from tandem.gateway.config import FallbackConfig, ShadowConfig

    flagged = {(section, name) for _, section, name, _, _ in SECTION_FLAGS}
    for section, cls, by_hand in (("gates", GateConfig, {"enabled"}), ("shadow", ShadowConfig, {"fraction",
                                  "keep_samples"}), ("fallback", FallbackConfig, set())):
        assert {f.name for f in dataclasses.fields(cls)} - by_hand == {n for s, n in flagged if s == section}
    path = tmp_path / "gateway.yaml"
    path.write_text("primary: 'http://a:1'\ncandidate: 'http://b:2'\nshadow: {max_concurrency: 2, timeout_s: 9}\n"
                    "fallback: {breaker_failures: 3, retry_ratio: 0.2}\n")
    args = build_parser().parse_args(["gateway", "--config", str(path), "--shadow-max-concurrency", "8",
                                      "--first-byte-timeout", "2.5", "--breaker-cooldown", "4",
                                      "--gate-min-comparisons", "20", "--shadow-fraction", "0.5"])
    cfg = gateway_config_from_args(args)
    assert (cfg.shadow.max_concurrency, cfg.shadow.timeout_s, cfg.shadow.fraction) == (8, 9, 0.5)
    assert (cfg.fallback.first_byte_timeout_s, cfg.fallback.breaker_cooldown_s, cfg.fallback.breaker_failures,
            cfg.fallback.retry_ratio) == (2.5, 4, 3, 0.2)
    assert cfg.gates.min_comparisons == 20
