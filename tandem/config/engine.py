"""The engine's config groups: ``ModelConfig``, ``CacheConfig``, ``SchedulerConfig``, ``SpeculativeConfig``
and their bundle ``EngineConfig``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from tandem.config.common import ConfigError, is_int
from tandem.config.kv import KVEventsConfig, KVTransferConfig

_DTYPES = ("bfloat16", "float32")
QUANTIZATION_METHODS = ("int8", "int4")
# Kernel paths (tandem/kernels/registry.py): "auto" picks the first compiled variant the CPU runs.
KERNEL_BACKENDS = ("auto", "avx512_bf16", "avx2", "torch")
# Waiting engine requests beyond which the server answers 429: a queue this deep already waits minutes on
# a CPU, and a bound keeps memory and latency finite under overload.
DEFAULT_MAX_QUEUE_LEN = 1024
SCHEDULING_POLICIES = ("fcfs", "priority", "lpm")
SPECULATIVE_METHODS = ("ngram", "draft", "pard", "self-quant")
SELF_QUANT_TYPES = ("int8", "int4")
MAX_SPECULATIVE_TOKENS = 16


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
        if not is_int(self.block_size) or self.block_size < 1:
            raise ConfigError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if not isinstance(self.kv_cache_gib, int | float) or not math.isfinite(self.kv_cache_gib) \
                or self.kv_cache_gib <= 0:
            raise ConfigError(f"kv_cache_gib must be a finite number > 0, got {self.kv_cache_gib!r}")
        if self.num_blocks is not None and (not is_int(self.num_blocks) or self.num_blocks < 2):
            raise ConfigError(f"num_blocks must be >= 2, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits per step: a token budget and a sequence cap.

    ``long_prefill_token_threshold`` caps one request's prefill chunk (tokens); 0 = budget only.
    ``max_long_partial_prefills``: with a threshold, at most this many requests with more than the
    threshold of tokens left compute at once, so short ones (prefix hits) overtake the rest (vLLM's
    option; ``scheduler/admission.py``); 0 = no limit.
    ``max_queue_len`` bounds the engine requests waiting in the server (the core's waiting queue plus
    those being tokenized or sent); beyond it the server answers 429. 0 = unbounded.
    ``policy`` orders admission: "fcfs" (arrival order), "priority" (``SamplingParams.priority``,
    lower first, ties by arrival; vLLM semantics) or "lpm" (longest prefix-cache hit first, ties by
    arrival; SGLang's policy, ``scheduler/lpm.py``), under which a request waits behind later arrivals
    for at most ``lpm_max_wait_steps`` steps.
    The library defaults are vLLM's (one 2,048-token budget, no chunk cap, FCFS); ``tandem serve``
    uses ``CPU_SERVE_SCHEDULING`` instead (see there).
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    long_prefill_token_threshold: int = 0
    max_long_partial_prefills: int = 0
    max_queue_len: int = DEFAULT_MAX_QUEUE_LEN
    policy: str = "fcfs"
    lpm_max_wait_steps: int = 32

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold must be >= 0")
        if self.max_long_partial_prefills < 0:
            raise ConfigError("max_long_partial_prefills must be >= 0")
        if self.max_queue_len < 0:
            raise ConfigError("max_queue_len must be >= 0")
        if self.policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")
        if not is_int(self.lpm_max_wait_steps) or self.lpm_max_wait_steps < 1:
            raise ConfigError(f"lpm_max_wait_steps must be an integer >= 1, got {self.lpm_max_wait_steps!r}")


# NOTE: the CPU serving default (`tandem serve`, `tandem engine`; the library keeps vLLM's). vLLM's CPU API
# server takes 2,048 tokens per step with no chunk cap; a GPU runs such a step in milliseconds, one CPU core
# in about 30 s (SmolLM2-135M, Zen 1, under load), and every running request's next token waits for it. So:
# chunks of at most 256 tokens (an eighth of that step), one prompt with more than that left computing at a
# time (vLLM V0's --max-long-partial-prefills default, 1), and prefix hits first (lpm): a hit samples within
# a step or two instead of queueing behind every long prompt's chunks. The budget (2,048) still lets many
# short prompts start together.
CPU_SERVE_SCHEDULING = SchedulerConfig(long_prefill_token_threshold=256, max_long_partial_prefills=1,
                                       policy="lpm")


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

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> SpeculativeConfig:
        """A config from a dict with Tandem's field names or vLLM's ``speculative_config`` keys
        (``model``, ``prompt_lookup_min``, ``prompt_lookup_max``), so a vLLM ``LLM(...,
        speculative_config={"method": "draft", "model": PATH, ...})`` call runs unchanged.

        Raises:
            ConfigError: an unknown key, a key given under both names, or an invalid value.
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in config.items():
            name = _VLLM_SPECULATIVE_KEYS.get(key, key)
            if name not in fields:
                raise ConfigError(f"unknown speculative_config key {key!r}; known: "
                                  f"{sorted(fields | set(_VLLM_SPECULATIVE_KEYS))}")
            if name in kwargs:
                raise ConfigError(f"speculative_config gives {name!r} twice (as {key!r} and its other name)")
            kwargs[name] = value
        return cls(**kwargs)

    @property
    def uses_draft_model(self) -> bool:
        """True when drafts come from a model with its own KV cache (every method but ngram)."""
        return self.method != "ngram"

# vLLM's speculative_config key -> SpeculativeConfig field.
_VLLM_SPECULATIVE_KEYS = {"model": "speculative_model", "prompt_lookup_min": "ngram_min",
                          "prompt_lookup_max": "ngram_max"}


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
