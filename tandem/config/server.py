"""The server process's config groups: ``ServerConfig`` (``tandem serve``'s own flags) and
``ParallelConfig`` (where the engine core runs, data parallelism, the engine secret)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from tandem.config.common import ConfigError, is_int, is_loopback_host, parse_tcp_address

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "pythonic")  # tandem/server/tool_parsers.py
ENGINE_SECRET_ENV = "TANDEM_ENGINE_SECRET"  # the engine secret when no --engine-secret-file is given
DATA_PARALLEL_BACKENDS = ("mp", "ray")
ROUTING_POLICIES = ("round-robin", "least-load", "kv-aware")  # tandem/router/policy.py


@dataclass(frozen=True)
class ServerConfig:
    """``tandem serve``'s own settings (the engine's are in ``EngineConfig``), one field per flag.

    ``served_model_names`` empty: the ``--model`` value (or the default model's name).
    ``shutdown_timeout``: seconds in-flight requests may run after SIGTERM before they are ended.
    ``core_restart_limit`` / ``core_restart_window``: the engine core is restarted after it dies,
    unless this is its ``core_restart_limit``-th death within ``core_restart_window`` seconds (a crash
    loop); 1 never restarts. ``instance_id``: this server's id in ``/load`` and the metrics labels
    (None: a random uuid at start-up). ``enable_auto_tool_choice`` / ``tool_call_parser`` (vLLM's
    flags): ``tool_choice: "auto"`` is served only with both; the parser reads calls from the text.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_names: tuple[str, ...] = ()
    log_requests: bool = False
    shutdown_timeout: float = 30.0
    core_restart_limit: int = 3
    core_restart_window: float = 60.0
    instance_id: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got "
                              f"{self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("enable_auto_tool_choice needs a tool_call_parser (--tool-call-parser)")
        if not is_int(self.port) or not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be 0-65535, got {self.port!r}")
        if not self.host:
            raise ConfigError("host must not be empty")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key must not be empty (leave it unset for no key)")
        if any(not name for name in self.served_model_names):
            raise ConfigError("served model names must not be empty")
        if not math.isfinite(self.shutdown_timeout) or self.shutdown_timeout < 0:
            raise ConfigError(f"shutdown_timeout must be a finite number >= 0, got {self.shutdown_timeout}")
        if not is_int(self.core_restart_limit) or self.core_restart_limit < 1:
            raise ConfigError(f"core_restart_limit must be an integer >= 1, got {self.core_restart_limit!r}")
        if not math.isfinite(self.core_restart_window) or self.core_restart_window <= 0:
            raise ConfigError(f"core_restart_window must be a finite number > 0, got {self.core_restart_window}")
        if self.instance_id is not None and not self.instance_id.strip():
            raise ConfigError("instance_id must not be blank")


@dataclass(frozen=True)
class ParallelConfig:
    """Where the engine core runs and who may talk to it, one field per flag.

    ``engine_address``: ``tandem serve`` connects to the engine core at this ``tcp://host:port``
    instead of starting one (None: a local core process). ``listen_address``: ``tandem engine``
    serves one engine core on this ``tcp://host:port``. ``engine_secret_file``: a file holding the
    shared secret (surrounding whitespace stripped); without it the secret comes from the
    ``TANDEM_ENGINE_SECRET`` environment variable, if set. The secret itself is never stored here
    (``secret()`` reads it). ``data_parallel_size``: engine cores behind one server, each request
    routed to one of them by ``routing_policy`` (``tandem/router/policy.py``).
    ``data_parallel_backend``: "mp" (child processes of the server, on disjoint CPU sets) or "ray"
    (Ray actors in a placement group, reached over TCP; ``ray_address`` names the cluster, None =
    ``ray.init``'s default: ``$RAY_ADDRESS``, a running local cluster, or a new one).

    Raises (on creation):
        ConfigError: a malformed address, an unreadable or empty secret file, a non-loopback
            ``listen_address`` without a secret, ``data_parallel_size`` < 1, an unknown backend or
            policy, or data parallelism together with ``engine_address``.
    """

    engine_address: str | None = None
    listen_address: str | None = None
    engine_secret_file: str | None = None
    data_parallel_size: int = 1
    data_parallel_backend: str = "mp"
    ray_address: str | None = None
    routing_policy: str = "kv-aware"

    def __post_init__(self) -> None:
        if not is_int(self.data_parallel_size) or self.data_parallel_size < 1:
            raise ConfigError(f"data_parallel_size must be an integer >= 1, got {self.data_parallel_size!r}")
        if self.data_parallel_backend not in DATA_PARALLEL_BACKENDS:
            raise ConfigError(f"data_parallel_backend must be one of {DATA_PARALLEL_BACKENDS}, "
                              f"got {self.data_parallel_backend!r}")
        if self.routing_policy not in ROUTING_POLICIES:
            raise ConfigError(f"routing_policy must be one of {ROUTING_POLICIES}, got {self.routing_policy!r}")
        if self.ray_address is not None and self.data_parallel_backend != "ray":
            raise ConfigError("ray_address needs data_parallel_backend 'ray'")
        if self.engine_address is not None and (self.data_parallel_size > 1 or self.data_parallel_backend != "mp"):
            raise ConfigError("engine_address serves one remote engine core; it cannot be combined with "
                              "data_parallel_size > 1 or the ray backend")
        if self.engine_address is not None:
            parse_tcp_address(self.engine_address)
        secret = self.secret()
        if self.listen_address is not None:
            host, _ = parse_tcp_address(self.listen_address)
            if not is_loopback_host(host) and secret is None:
                raise ConfigError(
                    f"refusing to listen on {self.listen_address} without a shared secret: anyone who can reach "
                    f"that address could use the engine; pass --engine-secret-file FILE (or set {ENGINE_SECRET_ENV}), "
                    "or listen on tcp://127.0.0.1:PORT")

    def secret(self) -> bytes | None:
        """The shared secret (from ``engine_secret_file``, else ``$TANDEM_ENGINE_SECRET``), or None.

        Raises:
            ConfigError: the file cannot be read or holds only whitespace.
        """
        import os

        if self.engine_secret_file is not None:
            try:
                text = Path(self.engine_secret_file).read_bytes().strip()
            except OSError as e:
                raise ConfigError(f"cannot read the engine secret file {self.engine_secret_file}: "
                                  f"{e.strerror or e}") from None
            if not text:
                raise ConfigError(f"the engine secret file {self.engine_secret_file} is empty")
            return text
        value = os.environ.get(ENGINE_SECRET_ENV, "").strip()
        return value.encode() if value else None
