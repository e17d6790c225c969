"""Frozen configuration of `tandem gateway`: backends, canary steps, gates, shadow, fallback.

The CLI flags and the optional YAML file (`--config gateway.yaml`) map onto these dataclasses one
to one; flags given on the command line win over the file. Times are seconds, weights and rates
fractions in [0, 1]. Every class validates itself in `__post_init__` and raises ValueError.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PRIMARY, CANDIDATE = "primary", "candidate"
_USERINFO = re.compile(r"(?<=://)[^/@\s]*@")


def redact_text(text: str) -> str:
    """`text` (a backend URL, an error message, a log line) with the userinfo (`user:password@`) of
    any URL in it replaced by `***@`: httpx sends a URL's userinfo as Basic credentials."""
    return _USERINFO.sub("***@", text)


def strip_userinfo(url: str) -> str:
    """`url` without its userinfo (`user:password@`): the origin a backend's answers name."""
    return _USERINFO.sub("", url)


def _fraction(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")


@dataclass(frozen=True)
class BackendConfig:
    """One upstream OpenAI-compatible server.

    url: its root (a trailing `/v1` is tolerated; userinfo `user:password@` is sent as Basic
    credentials and never shown); api_key: sent to it as `Authorization: Bearer` instead of the
    client's key (None: no Authorization header; not with URL userinfo); model_map: client model name ->
    this backend's model name, rewritten in request bodies.
    """

    name: str
    url: str
    api_key: str | None = None
    model_map: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"backend {self.name!r}: url must start with http:// or https://, "
                             f"got {redact_text(self.url)!r}")
        if self.api_key is not None and _USERINFO.search(self.url):
            # NOTE: httpx would send the userinfo as Basic credentials in place of the key
            raise ValueError(f"backend {self.name!r}: give its credentials as api_key or as URL userinfo, not both")
        object.__setattr__(self, "url", self.url.rstrip("/").removesuffix("/v1"))


@dataclass(frozen=True)
class CanaryStep:
    """Hold the candidate at `weight` for `hold_s` seconds while the gates pass, then promote."""

    weight: float
    hold_s: float

    def __post_init__(self) -> None:
        _fraction("canary step weight", self.weight)
        if self.hold_s < 0:
            raise ValueError(f"canary step hold must be >= 0 s, got {self.hold_s}")


@dataclass(frozen=True)
class CanaryConfig:
    """Share of client requests sent to the candidate.

    weight: the starting share; steps: optional promotion ladder, entered after the start (the
    weight becomes steps[0].weight at once when steps are given); sticky_header: a request header
    whose value pins a client to one side (the body's `user` field is used when it is absent).
    """

    weight: float = 0.0
    steps: tuple[CanaryStep, ...] = ()
    sticky_header: str = "x-session-id"

    def __post_init__(self) -> None:
        _fraction("canary weight", self.weight)


@dataclass(frozen=True)
class GateConfig:
    """Rollback gates, evaluated over the last `window_s` seconds once the candidate has served
    `min_requests` there. A gate fails when the candidate's error rate exceeds `max_error_rate`,
    its p95 TTFT or TPOT exceeds `max_latency_ratio` x the primary's (checked only once both sides
    have `min_latency_samples` streamed answers in the window: a non-streamed answer has no TTFT),
    or the shadow divergence rate exceeds `max_divergence_rate` (checked once `min_comparisons`
    comparisons are in the window). `enabled: false` turns every gate off (steps still promote)."""

    window_s: float = 60.0
    min_requests: int = 10
    max_error_rate: float = 0.05
    max_latency_ratio: float = 2.0
    min_latency_samples: int = 30
    max_divergence_rate: float = 0.2
    min_comparisons: int = 10
    enabled: bool = True

    def __post_init__(self) -> None:
        _positive("gate window", self.window_s)
        _fraction("max error rate", self.max_error_rate)
        _fraction("max divergence rate", self.max_divergence_rate)
        _positive("max latency ratio", self.max_latency_ratio)
        if self.min_requests < 1 or self.min_comparisons < 1 or self.min_latency_samples < 1:
            raise ValueError("gate min_requests, min_comparisons and min_latency_samples must be >= 1")


@dataclass(frozen=True)
class ShadowConfig:
    """fraction: share of primary-served requests also sent to the candidate; max_concurrency:
    shadow legs in flight at once (a sample beyond it is dropped, never queued); keep_samples:
    store redacted prompt/answer samples of divergences (default: hashes and lengths only);
    timeout_s: a shadow leg's limit."""

    fraction: float = 0.0
    max_concurrency: int = 4
    keep_samples: bool = False
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        _fraction("shadow fraction", self.fraction)
        if self.max_concurrency < 1:
            raise ValueError(f"shadow max concurrency must be >= 1, got {self.max_concurrency}")
        _positive("shadow timeout", self.timeout_s)


@dataclass(frozen=True)
class FallbackConfig:
    """first_byte_timeout_s: a backend that sends no response head within it is a failure (the next
    backend is tried); retry_ratio / min_retries: the retry budget, retries allowed in the gate
    window are max(min_retries, retry_ratio x requests); breaker_failures consecutive failures open
    a backend's breaker for breaker_cooldown_s, then one half-open probe request decides."""

    first_byte_timeout_s: float = 30.0
    read_timeout_s: float = 300.0
    retry_ratio: float = 0.5
    min_retries: int = 10
    breaker_failures: int = 5
    breaker_cooldown_s: float = 10.0

    def __post_init__(self) -> None:
        _positive("first byte timeout", self.first_byte_timeout_s)
        _positive("read timeout", self.read_timeout_s)
        _fraction("retry ratio", self.retry_ratio)
        if self.min_retries < 0 or self.breaker_failures < 1:
            raise ValueError("min_retries must be >= 0 and breaker_failures >= 1")
        _positive("breaker cooldown", self.breaker_cooldown_s)


@dataclass(frozen=True)
class GatewayConfig:
    """The whole gateway: two backends, the client key, and the policies above. max_body_mib: the
    largest request body accepted (MiB; a larger one is a 413 before anything is sent on)."""

    primary: BackendConfig
    candidate: BackendConfig | None = None
    api_key: str | None = None
    host: str = "127.0.0.1"
    port: int = 8100
    max_body_mib: float = 32.0
    canary: CanaryConfig = CanaryConfig()
    gates: GateConfig = GateConfig()
    shadow: ShadowConfig = ShadowConfig()
    fallback: FallbackConfig = FallbackConfig()

    def __post_init__(self) -> None:
        if self.candidate is None and (self.canary.weight > 0 or self.canary.steps or self.shadow.fraction > 0):
            raise ValueError("canary weight, canary steps and shadowing need a --candidate")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        _positive("max_body_mib", self.max_body_mib)

    def backends(self) -> list[BackendConfig]:
        return [self.primary] + ([self.candidate] if self.candidate else [])


_KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "float": ("a number", lambda v: isinstance(v, int | float) and not isinstance(v, bool)),
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "str | None": ("a string", lambda v: v is None or isinstance(v, str)),
}


def _check(where: str, kind: str, value: Any) -> None:
    """Raises ValueError naming the setting when `value` is not of `kind` (a key of _KINDS)."""
    label, ok = _KINDS[kind]
    if not ok(value):
        raise ValueError(f"{where}: expected {label}, got {value!r}")


def _mapping(raw: Any, where: str, known: set[str]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a mapping, got {raw!r}")
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} (known: {sorted(known)})")
    return raw


def _section(cls: type, raw: Any, where: str) -> Any:
    if raw is None:
        return cls()
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    for key, value in _mapping(raw, where, set(fields)).items():
        if fields[key] in _KINDS:
            _check(f"{where}.{key}", fields[key], value)
    return cls(**raw)


def _backend(name: str, raw: Any) -> BackendConfig | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        return BackendConfig(name, raw)
    raw = _mapping(raw, name, {"url", "api_key", "model_map"})
    if "url" not in raw:
        raise ValueError(f"{name}: url is required")
    _check(f"{name}.url", "str", raw["url"])
    _check(f"{name}.api_key", "str | None", raw.get("api_key"))
    model_map = raw.get("model_map") or {}
    if not isinstance(model_map, dict) or not all(isinstance(v, str) for v in (*model_map, *model_map.values())):
        raise ValueError(f"{name}.model_map: expected a mapping of client model name -> {name} model name, "
                         f"got {model_map!r}")
    return BackendConfig(name=name, url=raw["url"], api_key=raw.get("api_key"), model_map=dict(model_map))


def config_from_mapping(data: dict[str, Any]) -> GatewayConfig:
    """A GatewayConfig from a parsed YAML/JSON mapping with keys primary, candidate, api_key, host,
    port, max_body_mib, canary (weight, steps: [{weight, hold_s}], sticky_header), gates, shadow, fallback.

    Raises ValueError naming the setting on an unknown key, a missing primary or a bad value.
    """
    known = {"primary", "candidate", "api_key", "host", "port", "max_body_mib", "canary", "gates", "shadow", "fallback"}
    _mapping(data, "gateway config", known)
    primary = _backend(PRIMARY, data.get("primary"))
    if primary is None:
        raise ValueError("gateway config: a primary backend is required")
    for key, kind in (("api_key", "str | None"), ("host", "str"), ("port", "int"), ("max_body_mib", "float")):
        if key in data:
            _check(key, kind, data[key])
    canary_raw = dict(_mapping(data.get("canary") or {}, "canary", {f.name for f in dataclasses.fields(CanaryConfig)}))
    raw_steps = canary_raw.pop("steps", None) or []
    if not isinstance(raw_steps, list):
        raise ValueError(f"canary.steps: expected a list of {{weight, hold_s}}, got {raw_steps!r}")
    steps = tuple(_section(CanaryStep, s, f"canary.steps[{i}]") for i, s in enumerate(raw_steps))
    canary = _section(CanaryConfig, canary_raw, "canary")
    return GatewayConfig(
        primary=primary, candidate=_backend(CANDIDATE, data.get("candidate")), api_key=data.get("api_key"),
        host=data.get("host", "127.0.0.1"), port=data.get("port", 8100), max_body_mib=data.get("max_body_mib", 32.0),
        canary=dataclasses.replace(canary, steps=steps), gates=_section(GateConfig, data.get("gates"), "gates"),
        shadow=_section(ShadowConfig, data.get("shadow"), "shadow"),
        fallback=_section(FallbackConfig, data.get("fallback"), "fallback"),
    )
