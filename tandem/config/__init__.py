"""Frozen configuration dataclasses, validated in ``__post_init__``; the CLI maps onto them one to one.

One module per group: ``engine`` (model, cache, scheduler, speculation, the ``EngineConfig`` bundle),
``kv`` (KV transfer and KV events), ``server`` (``tandem serve`` and parallelism), ``common`` (the
error and the checks they share). Import every name from ``tandem.config``.
"""

from tandem.config.common import ConfigError, is_loopback_host, parse_tcp_address
from tandem.config.engine import (
    CPU_SERVE_SCHEDULING,
    DEFAULT_MAX_QUEUE_LEN,
    KERNEL_BACKENDS,
    MAX_SPECULATIVE_TOKENS,
    QUANTIZATION_METHODS,
    SCHEDULING_POLICIES,
    SELF_QUANT_TYPES,
    SPECULATIVE_METHODS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tandem.config.kv import (
    KV_CONNECTORS,
    KV_EVENTS_PUBLISHERS,
    KV_ROLES,
    KV_SECRET_ENV,
    PREFILL_FAILURE_POLICIES,
    KVEventsConfig,
    KVTransferConfig,
)
from tandem.config.server import (
    DATA_PARALLEL_BACKENDS,
    ENGINE_SECRET_ENV,
    ROUTING_POLICIES,
    TOOL_CALL_PARSERS,
    ParallelConfig,
    ServerConfig,
)

__all__ = [
    "CPU_SERVE_SCHEDULING", "DATA_PARALLEL_BACKENDS", "DEFAULT_MAX_QUEUE_LEN", "ENGINE_SECRET_ENV", "KERNEL_BACKENDS",
    "KV_CONNECTORS",
    "KV_EVENTS_PUBLISHERS", "KV_ROLES", "KV_SECRET_ENV", "MAX_SPECULATIVE_TOKENS", "PREFILL_FAILURE_POLICIES",
    "QUANTIZATION_METHODS", "ROUTING_POLICIES", "SCHEDULING_POLICIES", "SELF_QUANT_TYPES", "SPECULATIVE_METHODS",
    "TOOL_CALL_PARSERS", "CacheConfig", "ConfigError", "EngineConfig", "KVEventsConfig", "KVTransferConfig",
    "ModelConfig", "ParallelConfig", "SchedulerConfig", "ServerConfig", "SpeculativeConfig", "is_loopback_host",
    "parse_tcp_address",
]
