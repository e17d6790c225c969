"""``RouterConfig``: the frozen settings of ``tandem router``, mapped one to one from its flags."""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import urlsplit

from tandem.config import ConfigError
from tandem.router.policy import DEFAULT_BETA, DEFAULT_MIN_MATCH, DEFAULT_POLICY, POLICIES


def _check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"a backend must be an http(s) URL like http://127.0.0.1:8000, got {url!r}")
    return url.rstrip("/")


@dataclass(frozen=True)
class RouterConfig:
    """Settings of the standalone router (``tandem/router/app.py``).

    Attributes:
        backends: base URLs of OpenAI-compatible servers (without ``/v1``).
        policy / beta: the routing policy (``policy.POLICIES``) and kv-aware's load weight.
        min_match: kv-aware's smallest cached fraction that counts (``policy.KVAwarePolicy``).
        tokenizer: a local tokenizer folder or ``.gguf`` (None: the first backend's ``/v1/models``
            ``root`` when it is a local path); required by ``kv-aware``.
        chat_template: a Jinja template (text) for chat prompts, as the backends were given.
        block_size: KV block size in tokens (None: a Tandem backend's ``/load``, else 16).
        kv_events: (backend URL, ZeroMQ endpoint) pairs; other Tandem backends are asked (``/load``).
        max_outstanding_per_backend: router-side cap on a backend's requests in flight (None: none).
        health_interval_s: seconds between active ``/health`` checks of each backend.
        failure_threshold, eject_s, max_eject_s: see ``health.BackendHealth``.
        connect_timeout_s / request_timeout_s: to a backend: connecting / silence between two reads.
        first_byte_timeout_s: seconds a request waits for its answer's first body byte before it is
            retried once on another backend and the backend counted as failed (0, the default: no
            limit; a hung server's requests are still retried once its ``/health`` probe ejects it).
            NOTE: off by default because a healthy CPU backend's queue makes long first bytes
            (``router_bench``'s TTFT p99 reached 30-95 s), and a request without ``stream`` gets its
            first byte only with the whole answer: a timeout there would retry work, not failures.
        retry_after_s: the ``Retry-After`` of the router's own 429 and 503 answers.
        backend_startup_timeout_s: how long the router waits at start for a backend to answer
            ``/v1/models`` when it must find the tokenizer there (kv-aware without ``tokenizer``):
            backends may still be loading (0: do not wait).
        approx_capacity_blocks: the assumed cache size of a backend without KV events (None: its
            ``/load`` ``num_kv_blocks``, else ``kv_index.DEFAULT_APPROX_CAPACITY_BLOCKS``).

    Raises (on creation):
        ConfigError: no backend, a malformed URL, an unknown policy, or a bound out of range (NaN and
            infinite times or beta included, min_match outside [0, 1]).
    """

    backends: tuple[str, ...]
    policy: str = DEFAULT_POLICY
    beta: float = DEFAULT_BETA
    min_match: float = DEFAULT_MIN_MATCH
    tokenizer: str | None = None
    chat_template: str | None = None
    block_size: int | None = None
    kv_events: tuple[tuple[str, str], ...] = ()
    max_outstanding_per_backend: int | None = None
    health_interval_s: float = 1.0
    failure_threshold: int = 3
    eject_s: float = 2.0
    max_eject_s: float = 30.0
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 600.0
    first_byte_timeout_s: float = 0.0
    retry_after_s: float = 1.0
    backend_startup_timeout_s: float = 300.0
    approx_capacity_blocks: int | None = None
    host: str = "127.0.0.1"
    port: int = 8080

    def __post_init__(self) -> None:
        if not self.backends:
            raise ConfigError("the router needs at least one --backend URL")
        object.__setattr__(self, "backends", tuple(_check_url(u) for u in self.backends))
        if len(set(self.backends)) != len(self.backends):
            raise ConfigError(f"a backend is listed twice: {list(self.backends)}")
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown routing policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if not (math.isfinite(self.beta) and self.beta >= 0):
            raise ConfigError(f"--kv-beta must be a finite number >= 0, got {self.beta}")
        if not 0 <= self.min_match <= 1:
            raise ConfigError(f"--kv-min-match must be in 0-1, got {self.min_match}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0-65535, got {self.port}")
        events = tuple((_check_url(u), e) for u, e in self.kv_events)
        object.__setattr__(self, "kv_events", events)
        for url, endpoint in events:
            if url not in self.backends:
                raise ConfigError(f"--kv-events names {url}, which is not a --backend")
            if not endpoint.startswith(("tcp://", "ipc://")):
                raise ConfigError(f"--kv-events endpoint must be a ZeroMQ address like tcp://HOST:PORT, "
                                  f"got {endpoint!r}")
        for name in ("block_size", "max_outstanding_per_backend", "approx_capacity_blocks"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        for name in ("health_interval_s", "eject_s", "max_eject_s", "connect_timeout_s", "request_timeout_s",
                     "retry_after_s"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                raise ConfigError(f"{name} must be a finite number > 0, got {getattr(self, name)}")
        for flag, value in (("--backend-startup-timeout", self.backend_startup_timeout_s),
                            ("--first-byte-timeout", self.first_byte_timeout_s)):
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"{flag} must be a finite number >= 0, got {value}")
        if self.max_eject_s < self.eject_s:
            raise ConfigError(f"max_eject_s ({self.max_eject_s}) must be >= eject_s ({self.eject_s})")
        if self.failure_threshold < 1:
            raise ConfigError(f"failure_threshold must be >= 1, got {self.failure_threshold}")
