"""Frozen configuration dataclasses, validated in ``__post_init__``; the CLI maps onto them one to one."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.disagg.peers import PeerAllowlist

_DTYPES = ("bfloat16", "float32")
QUANTIZATION_METHODS = ("int8", "int4")
# Kernel paths (tandem/kernels/registry.py): "auto" picks the first compiled variant the CPU runs.
KERNEL_BACKENDS = ("auto", "avx512_bf16", "avx2", "torch")
# Waiting engine requests beyond which the server answers 429: a queue this deep already waits minutes on
# a CPU, and a bound keeps memory and latency finite under overload.
DEFAULT_MAX_QUEUE_LEN = 1024
SCHEDULING_POLICIES = ("fcfs", "priority")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ConfigError(ValueError):
    """An invalid configuration value (a user error at start-up)."""


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and how.

    ``model`` is a local folder (HF checkpoint), a ``.gguf`` file, or None for the default model
    (SmolLM2-135M-Instruct). ``max_model_len`` caps the context (tokens); None uses the model's own.
    ``quantization`` stores the linear layers' weights as int8 or int4 (``tandem/models/quant.py``).
    ``kernel_backend``: one of ``KERNEL_BACKENDS`` for the engine's kernels (``tandem/kernels/registry.py``);
    None keeps ``$TANDEM_KERNEL_BACKEND`` (``auto`` when unset).
    """

    model: str | None = None
    dtype: str = "bfloat16"
    max_model_len: int | None = None
    chat_template: str | None = None
    seed: int = 0
    quantization: str | None = None
    kernel_backend: str | None = None

    def __post_init__(self) -> None:
        if self.kernel_backend is not None and self.kernel_backend not in KERNEL_BACKENDS:
            raise ConfigError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ConfigError(f"quantization must be one of {QUANTIZATION_METHODS}, got {self.quantization!r}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: ``block_size`` tokens per block, a pool sized from ``kv_cache_gib`` GiB.

    ``num_blocks`` overrides the GiB budget (tests use it to force preemption).
    """

    block_size: int = 16
    kv_cache_gib: float = 2.0
    num_blocks: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not _is_int(self.block_size) or self.block_size < 1:
            raise ConfigError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if not isinstance(self.kv_cache_gib, int | float) or not math.isfinite(self.kv_cache_gib) \
                or self.kv_cache_gib <= 0:
            raise ConfigError(f"kv_cache_gib must be a finite number > 0, got {self.kv_cache_gib!r}")
        if self.num_blocks is not None and (not _is_int(self.num_blocks) or self.num_blocks < 2):
            raise ConfigError(f"num_blocks must be >= 2, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits per step: a token budget and a sequence cap.

    ``long_prefill_token_threshold`` caps one request's prefill chunk (tokens); 0 = budget only.
    ``max_queue_len`` bounds the engine requests waiting in the server (the core's waiting queue plus
    those being tokenized or sent); beyond it the server answers 429. 0 = unbounded.
    ``policy`` orders admission: "fcfs" (arrival order) or "priority" (``SamplingParams.priority``,
    lower first, ties by arrival; vLLM semantics).
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    long_prefill_token_threshold: int = 0
    max_queue_len: int = DEFAULT_MAX_QUEUE_LEN
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold must be >= 0")
        if self.max_queue_len < 0:
            raise ConfigError("max_queue_len must be >= 0")
        if self.policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")


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
        if not _is_int(self.port) or not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be 0-65535, got {self.port!r}")
        if not self.host:
            raise ConfigError("host must not be empty")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key must not be empty (leave it unset for no key)")
        if any(not name for name in self.served_model_names):
            raise ConfigError("served model names must not be empty")
        if not math.isfinite(self.shutdown_timeout) or self.shutdown_timeout < 0:
            raise ConfigError(f"shutdown_timeout must be a finite number >= 0, got {self.shutdown_timeout}")
        if not _is_int(self.core_restart_limit) or self.core_restart_limit < 1:
            raise ConfigError(f"core_restart_limit must be an integer >= 1, got {self.core_restart_limit!r}")
        if not math.isfinite(self.core_restart_window) or self.core_restart_window <= 0:
            raise ConfigError(f"core_restart_window must be a finite number > 0, got {self.core_restart_window}")
        if self.instance_id is not None and not self.instance_id.strip():
            raise ConfigError("instance_id must not be blank")


TOOL_CALL_PARSERS = ("hermes", "llama3_json", "pythonic")  # tandem/server/tool_parsers.py
SPECULATIVE_METHODS = ("ngram", "draft", "pard", "self-quant")
SELF_QUANT_TYPES = ("int8", "int4")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: how drafts are proposed and how many per step.

    ``method``: "ngram" (prompt lookup over the request's own tokens, n in [``ngram_min``,
    ``ngram_max``]), "draft" (a smaller model, ``speculative_model``, proposing autoregressively),
    "pard" (a PARD draft proposing all tokens in one forward with ``pard_mask_token_id``, or the
    draft's ``config.json`` key ``pard_token`` when None) or "self-quant" (the target's own weights
    quantized to ``quantization`` int8 / int4 as the draft). ``num_speculative_tokens`` = k drafts
    verified per step.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    speculative_model: str | None = None
    pard_mask_token_id: int | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    quantization: str = "int8"

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                              f"got {self.num_speculative_tokens}")
        if self.method in ("draft", "pard") and not self.speculative_model:
            raise ConfigError(f"speculative method {self.method!r} needs speculative_model (a draft folder)")
        if self.method in ("ngram", "self-quant") and self.speculative_model:
            raise ConfigError(f"speculative method {self.method!r} takes no speculative_model")
        if self.pard_mask_token_id is not None and self.pard_mask_token_id < 0:
            raise ConfigError(f"pard_mask_token_id must be >= 0, got {self.pard_mask_token_id}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.quantization not in SELF_QUANT_TYPES:
            raise ConfigError(f"quantization must be one of {SELF_QUANT_TYPES}, got {self.quantization!r}")

    @property
    def uses_draft_model(self) -> bool:
        """True when drafts come from a model with its own KV cache (every method but ngram)."""
        return self.method != "ngram"


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
PREFILL_FAILURE_POLICIES = ("fail", "local")
KV_CONNECTORS = ("TandemConnector",)
KV_SECRET_ENV = "TANDEM_KV_SECRET"  # the KV transfer secret when the config names none


@dataclass(frozen=True)
class KVTransferConfig:
    """Disaggregated prefill/decode (``tandem/disagg``), spelled as vLLM's ``--kv-transfer-config``.

    ``kv_role``: "kv_producer" (prefill side: serves its held KV blocks on ``kv_ip:kv_port``),
    "kv_consumer" (decode side: pulls them), "kv_both". ``engine_id``: this engine's name in
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
        if not _is_int(self.kv_port) or not 1 <= self.kv_port <= 65535:
            raise ConfigError(f"kv_port must be 1-65535, got {self.kv_port!r}")
        for name in ("lease_ttl_s", "transfer_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
        if self.kv_buffer_device != "cpu":
            raise ConfigError(f"kv_buffer_device must be 'cpu' (Tandem runs on CPUs), got {self.kv_buffer_device!r}")
        if not self.kv_ip:
            raise ConfigError("kv_ip must not be empty")
        self._check_prefill_hosts()
        if self.is_producer and not is_loopback_host(self.kv_ip) and self.shared_secret() is None:
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
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
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


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine core needs, in one frozen bundle (``speculative`` None = no speculation)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_threads: int | None = None  # torch intra-op threads; None = all cores
    speculative: SpeculativeConfig | None = None
    # OpenMP thread pinning of the engine (``tandem/worker/cpu_env.py``): "none" leaves the OS to place
    # threads, "auto" pins one thread per allowed core, "0-1,3" pins thread i to the i-th listed core.
    cpu_bind: str = "none"
    kv_transfer: KVTransferConfig | None = None  # disaggregated prefill/decode (tandem/disagg)
    kv_events: KVEventsConfig | None = None  # None: no KV events (``KVEventsConfig``)

    def __post_init__(self) -> None:
        if not isinstance(self.cpu_bind, str) or not self.cpu_bind.strip():
            raise ConfigError(f"cpu_bind must be 'auto', 'none' or a core list like '0-3,6', got {self.cpu_bind!r}")


ENGINE_SECRET_ENV = "TANDEM_ENGINE_SECRET"  # the engine secret when no --engine-secret-file is given
DATA_PARALLEL_BACKENDS = ("mp", "ray")
ROUTING_POLICIES = ("round-robin", "least-load", "kv-aware")  # tandem/router/policy.py


def parse_tcp_address(address: str) -> tuple[str, int]:
    """``tcp://host:port`` (IPv6 hosts in brackets) -> (host, port).

    Raises:
        ConfigError: another scheme, no host, or a port outside 1-65535.
    """
    if not isinstance(address, str) or not address.startswith("tcp://"):
        raise ConfigError(f"an engine address must look like tcp://HOST:PORT, got {address!r}")
    host, sep, port = address[len("tcp://"):].rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"an engine address must look like tcp://HOST:PORT with a port 1-65535, got {address!r}")
    return host, int(port)


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (127.0.0.0/8, ::1); False for names, ``*``,
    ``0.0.0.0`` and every other address."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
        if not _is_int(self.data_parallel_size) or self.data_parallel_size < 1:
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
