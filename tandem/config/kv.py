"""The KV cache's outside links: ``KVTransferConfig`` (disaggregated prefill/decode, vLLM's
``--kv-transfer-config``) and ``KVEventsConfig`` (vLLM's ``--kv-events-config``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.config.common import ConfigError, is_int, is_loopback_host

if TYPE_CHECKING:
    from tandem.disagg.peers import PeerAllowlist

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
PREFILL_FAILURE_POLICIES = ("fail", "local")
KV_CONNECTORS = ("TandemConnector",)
KV_SECRET_ENV = "TANDEM_KV_SECRET"  # the KV transfer secret when the config names none


@dataclass(frozen=True)
class KVTransferConfig:
    """Disaggregated prefill/decode (``tandem/disagg``), spelled as vLLM's ``--kv-transfer-config``.

    ``kv_role``: "kv_producer" (prefill side: serves its held KV blocks on ``kv_ip:kv_port``),
    "kv_consumer" (decode side: pulls them), "kv_both". ``kv_data_port``: where the producer takes the
    data connections that carry the block bytes (``disagg/data_channel.py``; 0: a free port, which the
    handshake announces). ``engine_id``: this engine's name in
    ``kv_transfer_params`` (None: a uuid at start). ``secret`` / ``secret_file``: the shared secret both
    sides prove in the handshake (else ``$TANDEM_KV_SECRET``); required to bind a non-loopback
    ``kv_ip``. ``prefill_failure_policy``: "local" prefills on the decode side when the producer is
    unreachable or the transfer fails; "fail" ends the request with an error (HTTP 503).
    ``lease_ttl_s``: seconds the producer holds a finished prefill's blocks unless renewed.
    ``transfer_timeout_s``: seconds the decode side waits for the producer's next message.
    ``prefill_hosts``: the producers a decode leg's ``remote_host`` / ``remote_port`` may name (IPs, CIDR
    networks, host names, each optionally ``:port``; ``disagg/peers.py``); None: loopback and this
    engine's own ``kv_ip``. Any other is refused with an HTTP 400 naming the host.
    """

    kv_connector: str = "TandemConnector"
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_data_port: int = 0
    engine_id: str | None = None
    secret: str | None = None
    secret_file: str | None = None
    prefill_failure_policy: str = "local"
    lease_ttl_s: float = 30.0
    transfer_timeout_s: float = 10.0
    kv_buffer_device: str = "cpu"
    prefill_hosts: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ConfigError(f"kv_connector must be one of {KV_CONNECTORS}, got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ConfigError(f"kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        if self.prefill_failure_policy not in PREFILL_FAILURE_POLICIES:
            raise ConfigError(f"prefill_failure_policy must be one of {PREFILL_FAILURE_POLICIES}, "
                              f"got {self.prefill_failure_policy!r}")
        if not is_int(self.kv_port) or not 1 <= self.kv_port <= 65535:
            raise ConfigError(f"kv_port must be 1-65535, got {self.kv_port!r}")
        if not is_int(self.kv_data_port) or not 0 <= self.kv_data_port <= 65535:
            raise ConfigError(f"kv_data_port must be 0 (any free port) or 1-65535, got {self.kv_data_port!r}")
        for name in ("lease_ttl_s", "transfer_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
        for name in ("kv_ip", "engine_id", "secret", "secret_file"):
            value = getattr(self, name)
            if not isinstance(value, str) and (value is not None or name == "kv_ip"):
                raise ConfigError(f"{name} must be a string, got {value!r}")
        if self.kv_buffer_device != "cpu":
            raise ConfigError(f"kv_buffer_device must be 'cpu' (Tandem runs on CPUs), got {self.kv_buffer_device!r}")
        if not self.kv_ip:
            raise ConfigError("kv_ip must not be empty")
        self._check_prefill_hosts()
        secret = self.shared_secret()  # NOTE: an empty or unreadable secret fails here, not after the model loaded
        if self.is_producer and not is_loopback_host(self.kv_ip) and secret is None:
            raise ConfigError(
                f"refusing to serve KV blocks on {self.kv_ip}:{self.kv_port} without a shared secret: the KV "
                f"cache holds what users wrote; set \"secret_file\" (or ${KV_SECRET_ENV}), or use kv_ip 127.0.0.1")

    def _check_prefill_hosts(self) -> None:
        hosts = self.prefill_hosts
        if hosts is None:
            return
        if isinstance(hosts, str) or not isinstance(hosts, list | tuple) or not all(isinstance(h, str) for h in hosts):
            raise ConfigError(f"prefill_hosts must be a list of hosts like [\"10.0.0.5\", \"10.0.1.0/24\", "
                              f"\"prefill-a:14579\"], got {hosts!r}")
        object.__setattr__(self, "prefill_hosts", tuple(hosts))
        from tandem.disagg.peers import PeerAllowlist

        try:
            PeerAllowlist(self.prefill_hosts)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def prefill_peers(self) -> PeerAllowlist:
        """The decode side's allowlist of producers (``disagg/peers.py``)."""
        from tandem.disagg.peers import PeerAllowlist

        return PeerAllowlist(self.prefill_hosts, self.kv_ip if self.is_producer else None)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def shared_secret(self) -> bytes | None:
        """The secret (``secret``, else ``secret_file``'s stripped text, else ``$TANDEM_KV_SECRET``) or None.

        Raises: ConfigError: an unreadable or empty secret file, or an empty secret.
        """
        import os

        if self.secret is not None:
            if not self.secret.strip():
                raise ConfigError("secret must not be empty")
            return self.secret.strip().encode()
        if self.secret_file is not None:
            try:
                text = Path(self.secret_file).read_bytes().strip()
            except OSError as e:
                raise ConfigError(f"cannot read the KV secret file {self.secret_file}: {e.strerror or e}") from None
            if not text:
                raise ConfigError(f"the KV secret file {self.secret_file} is empty")
            return text
        value = os.environ.get(KV_SECRET_ENV, "").strip()
        return value.encode() if value else None

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        """Parses ``--kv-transfer-config`` JSON (vLLM's keys; ``kv_connector_extra_config`` may carry the
        Tandem ones too). Raises: ConfigError: not a JSON object, an unknown key, or a bad value."""
        import dataclasses
        import json

        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--kv-transfer-config is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError("--kv-transfer-config must be a JSON object")
        extra = data.pop("kv_connector_extra_config", None) or {}
        if not isinstance(extra, dict):
            raise ConfigError("kv_connector_extra_config must be a JSON object")
        data = {**data, **extra}
        for key in ("kv_rank", "kv_parallel_size"):  # NOTE: vLLM's P2P connectors' keys; one engine each here
            if data.pop(key, None) not in (None, 0, 1):
                raise ConfigError(f"{key} is not supported by TandemConnector (one engine per side)")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown --kv-transfer-config keys {unknown}; known: {sorted(known)}")
        try:
            return cls(**data)
        except TypeError as e:
            raise ConfigError(f"--kv-transfer-config: {e}") from None


KV_EVENTS_PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    """KV cache events for KV-aware routers (``kv_cache/events.py``), vLLM's ``--kv-events-config`` fields.

    ``enable_kv_cache_events``: the engine records which blocks enter and leave its prefix cache.
    ``publisher``: "zmq" publishes each step's batch on a PUB socket bound to ``endpoint`` (frames
    ``[topic, seq, payload]``); "null" records nothing on the wire. None: "zmq" when enabled (vLLM's rule).
    ``endpoint``: a ZeroMQ address (``tcp://HOST:PORT``, ``tcp://HOST:*`` for a free port, ``ipc://PATH``);
    loopback by default (vLLM binds ``*``), since the hashes tell which prompts an engine has seen.
    ``replay_endpoint``: a ROUTER socket answering snapshot and replay requests (None: none).
    ``buffer_steps``: batches kept for replay. ``hwm``: the PUB socket's high-water mark (messages).
    With data parallelism engine ``i`` binds the endpoints' port + ``i`` (``for_rank``), as vLLM does.

    Raises (on creation):
        ConfigError: an unknown publisher, an endpoint that is not a ZeroMQ address, or a bound < 1.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in KV_EVENTS_PUBLISHERS:
            raise ConfigError(f"kv events publisher must be one of {KV_EVENTS_PUBLISHERS}, got {self.publisher!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.startswith(("tcp://", "ipc://",
                                                                                          "inproc://"))):
                raise ConfigError(f"kv events {name} must be a ZeroMQ address like tcp://127.0.0.1:5557, got {value!r}")
        for name in ("buffer_steps", "hwm"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ConfigError(f"kv events {name} must be an integer >= 1, got {getattr(self, name)!r}")

    @property
    def publishes(self) -> bool:
        """True when events go out on a ZeroMQ socket."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parses the ``--kv-events-config`` JSON object (vLLM's keys).

        Raises:
            ConfigError: not a JSON object, an unknown key, or an invalid value.
        """
        import dataclasses
        import json

        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--kv-events-config is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"--kv-events-config must be a JSON object, got {text!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"--kv-events-config has unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**data)

    def for_rank(self, rank: int) -> KVEventsConfig:
        """This config for data-parallel engine ``rank``: TCP ports shifted by ``rank`` (``*`` stays ``*``),
        ``ipc://`` paths suffixed with ``-rank``."""
        import dataclasses

        if rank == 0:
            return self
        return dataclasses.replace(self, endpoint=_shift_endpoint(self.endpoint, rank),
                                   replay_endpoint=None if self.replay_endpoint is None
                                   else _shift_endpoint(self.replay_endpoint, rank))

    def check_ranks(self, n: int) -> None:
        """Raises ConfigError when the endpoints of ``n`` data-parallel engines (``for_rank``) collide, e.g.
        ports 5557 and 5558 with ``-dp 2``: engine 1 would publish on engine 0's replay port."""
        seen: dict[str, str] = {}
        for rank in range(n):
            cfg = self.for_rank(rank)
            for kind, endpoint in (("endpoint", cfg.endpoint), ("replay_endpoint", cfg.replay_endpoint)):
                if endpoint is None or endpoint.endswith(":*"):
                    continue
                if endpoint in seen:
                    raise ConfigError(
                        f"--kv-events-config: with {n} data-parallel engines, engine {rank}'s {kind} {endpoint} is "
                        f"also {seen[endpoint]} (engine i uses each port + i): space the endpoint and "
                        f"replay_endpoint ports at least {n} apart")
                seen[endpoint] = f"engine {rank}'s {kind}"


def _shift_endpoint(endpoint: str, offset: int) -> str:
    if endpoint.startswith("tcp://"):
        head, _, port = endpoint.rpartition(":")
        return f"{head}:{int(port) + offset}" if port.isdigit() else endpoint
    return f"{endpoint}-{offset}"
