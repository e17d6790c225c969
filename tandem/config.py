"""Frozen configuration dataclasses, validated in ``__post_init__``; the CLI maps onto them one to one."""

from __future__ import annotations

from dataclasses import dataclass, field

_DTYPES = ("bfloat16", "float32")


class ConfigError(ValueError):
    """An invalid configuration value (a user error at start-up)."""


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and how.

    ``model`` is a local folder (HF checkpoint), a ``.gguf`` file, or None for the default model
    (SmolLM2-135M-Instruct). ``max_model_len`` caps the context (tokens); None uses the model's own.
    """

    model: str | None = None
    dtype: str = "bfloat16"
    max_model_len: int | None = None
    chat_template: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")


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
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_gib <= 0:
            raise ConfigError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ConfigError(f"num_blocks must be >= 2, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits per step: a token budget and a sequence cap.

    ``long_prefill_token_threshold`` caps one request's prefill chunk (tokens); 0 = budget only.
    ``max_queue_len`` bounds the waiting queue (0 = unbounded); the server returns 429 beyond it.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    long_prefill_token_threshold: int = 0
    max_queue_len: int = 0

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold must be >= 0")
        if self.max_queue_len < 0:
            raise ConfigError("max_queue_len must be >= 0")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine core needs, in one frozen bundle."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_threads: int | None = None  # torch intra-op threads; None = all cores
