"""One kernel registry: per operator, which backend runs it and up to which size.

Backends, in order of preference: ``avx512_bf16`` and ``avx2`` (the compiled variants of
``build.py``) and ``torch`` (stock PyTorch ops: every operator's reference and fallback). The
process runs one variant (``build.selected_variant``: CPU flags, or ``--kernel-backend`` /
``$TANDEM_KERNEL_BACKEND``); an operator runs on it when the variant declares the operator here
*and* its compiled module implements it, else on ``torch``. ``LIMITS`` gives each variant's largest
token count per call (None = any):

- linear layers: any M on both variants. Each computes a (token, row) value in one fixed order whatever
  the number of tokens in the call (batch invariance, issue 11 item 5), so prefill runs through them
  too: on ``avx512_bf16`` oneDNN's bf16 GEMM is faster above ~16 tokens but reduces in another order
  (README, Performance: the measured prefill cost).
- ``paged_attention``: the longest row (query tokens) the kernel attends (any); longer rows would go to SDPA.
- ``decoder_layer``: tokens per step (the whole step must fit its linears and its attention).

An operator a variant does not declare may name another variant in ``ROUTES``: the GGUF Q5_0 / Q4_K / Q6_K
linears and the fused MoE kernels (bf16 and quantized experts) exist only as AVX2 kernels, and
``avx512_bf16`` routes them to the ``avx2`` build (every CPU with
AVX-512 BF16 runs AVX2 code; the avx2 variant is then built and loaded beside the selected one). There
is no AVX-512 version of them yet: AVX-512 code cannot be tested on the AVX2 machines this was written on.

Callers ask ``use(op, tokens=T)`` at each call site. Nothing here is cached: the answer follows the
loaded variant (``configure`` may switch it before a model is built).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

from tandem.config import KERNEL_BACKENDS, ConfigError
from tandem.kernels import build

logger = logging.getLogger(__name__)

BACKENDS = ("avx512_bf16", "avx2", "torch")
UNLIMITED = 1 << 30  # what ``max_tokens`` returns for "any size" (fits the kernels' int64 arguments)

_LINEAR_OPS = ("linear_bf16", "linear_int8", "linear_int4", "linear_q8_0", "linear_q4_1")
# GGUF blocks, kernels/csrc/avx2/linear_kquant.cpp
_AVX2_ONLY_LINEAR_OPS = ("linear_q5_0", "linear_q4_k", "linear_q6_k")
# bf16 experts, kernels/csrc/avx2/moe.cpp; int8 / int4 / q8_0 experts, moe_quant.cpp; Q4_K / Q6_K, moe_kquant.cpp
_AVX2_ONLY_MOE_OPS = ("moe_bf16", "moe_int8", "moe_int4", "moe_q8_0", "moe_kquant")
# the greedy sampler's argmax (sample/ops.greedy_sample), kernels/csrc/avx2/argmax.cpp
_AVX2_ONLY_OPS = ("argmax",)
_DEQUANT_OPS = ("dequantize", "dequantize_q8_0", "dequantize_q4_1")
_ELEMENTWISE_OPS = ("rms_norm", "fused_add_rms_norm", "rotary", "rotary_", "silu_and_mul")
_THREAD_OPS = ("bind_omp_threads", "omp_thread_ids")


_NONE = -1  # a variant that does not declare the operator


def _limits(avx512_bf16: int | None, avx2: int | None) -> dict[str, int | None]:
    return {name: limit for name, limit in (("avx512_bf16", avx512_bf16), ("avx2", avx2)) if limit != _NONE}


# op -> {variant: max tokens per call (None = any)}; a variant missing from an op's dict lacks it.
# NOTE: no limit on avx512_bf16 either: oneDNN's bf16 GEMM (above ~16 tokens) and SDPA (prompt rows) are
# faster there but not batch-invariant (a prompt's last token would differ from the same token decoded alone).
LIMITS: dict[str, dict[str, int | None]] = {
    **{op: _limits(None, None) for op in _LINEAR_OPS},
    **{op: _limits(None, None) for op in _ELEMENTWISE_OPS + _THREAD_OPS},
    # dequantize for one oneDNN GEMM above a linear limit (none today); avx2's linears take every M
    **{op: _limits(None, _NONE) for op in _DEQUANT_OPS},
    "paged_attention": _limits(None, None),
    # bf16 weights packed at load (kernels.pack_bf16; models.layers.pack_linears), both variants
    "linear_bf16_packed": _limits(None, None),
    "decoder_layer": _limits(None, None),
    **{op: _limits(_NONE, None) for op in _AVX2_ONLY_LINEAR_OPS + _AVX2_ONLY_MOE_OPS + _AVX2_ONLY_OPS},
}
# op -> {selected variant: the variant whose kernel runs instead}, for operators the selected one lacks.
ROUTES: dict[str, dict[str, str]] = {op: {"avx512_bf16": "avx2"}
                                     for op in _AVX2_ONLY_LINEAR_OPS + _AVX2_ONLY_MOE_OPS + _AVX2_ONLY_OPS}

# What each path is, for the start-up line, /metrics and /version.
DESCRIPTIONS = {"avx512_bf16": "AVX-512 BF16 + VNNI", "avx2": "AVX2+FMA+F16C", "torch": "stock PyTorch ops"}
# NOTE: an estimate from the default model (SmolLM2-135M Q4_1), batch-1 decode, 2 threads: the torch
# backend (quantized weights dequantized once) made 4-8 tokens/s on a loaded 2-core AVX2 machine, against
# about 80 targeted with the kernels and 119 for llama.cpp on the same file (issue 11).
# NOTE: measured on the default model, 2 Zen 1 cores: 4.5-6 tokens/s on torch against 15-24 on avx2.
TORCH_COST = "decode is 3-5x slower than with the avx2/avx512_bf16 kernels"


def routed_variants() -> list[str]:
    """The variants other than the selected one that run some operator here (``ROUTES``), sorted."""
    variant = build.selected_variant()
    return sorted({to for routes in ROUTES.values() for frm, to in routes.items() if frm == variant and to != variant})


def selected() -> str:
    """The backend of this process: the loaded variant's name, or ``torch`` when none runs."""
    return build.selected_variant() or "torch"


def backend_for(op: str) -> str:
    """The backend that runs ``op`` here: the selected variant if it declares and implements ``op``,
    else ``torch``.

    Raises:
        KeyError: ``op`` is not an operator of ``LIMITS``.
    """
    return _backend_for(build.selected_variant(), op)


# NOTE: cached per (variant, op): layers ask on every call (about ten times per decoder layer and step),
# and a variant's module never changes once loaded; ``configure`` changes the variant, hence the key.
@functools.cache
def _backend_for(variant: str | None, op: str) -> str:
    limits = LIMITS[op]
    if variant is not None and variant not in limits:
        variant = ROUTES.get(op, {}).get(variant)
    if variant is None or variant not in limits:
        return "torch"
    module = build.load_variant(variant)
    return variant if module is not None and hasattr(module, op) else "torch"


@functools.cache
def _max_tokens(variant: str | None, op: str) -> int:
    backend = _backend_for(variant, op)
    if backend == "torch":
        return 0
    limit = LIMITS[op][backend]
    return UNLIMITED if limit is None else limit


def max_tokens(op: str) -> int:
    """The largest token count (or attention query length) ``op``'s kernel takes per call here;
    ``UNLIMITED`` for any size, 0 when ``op`` runs on ``torch``.

    Raises:
        KeyError: an unknown ``op``.
    """
    return _max_tokens(build.selected_variant(), op)


def use(op: str, tokens: int | None = None) -> bool:
    """Whether to call ``tandem.kernels.<op>`` for a call over ``tokens`` tokens (None: size-free op).

    Raises:
        KeyError: an unknown ``op``.
    """
    limit = _max_tokens(build.selected_variant(), op)
    return limit > 0 and (tokens is None or tokens <= limit)


def cache_clear() -> None:
    """Forgets the per-(variant, operator) answers (for tests that fake a loaded variant)."""
    _backend_for.cache_clear()
    _max_tokens.cache_clear()


def missing_ops(backend: str | None = None) -> list[str]:
    """Operators the ``backend`` (default: the selected one) declares but its build lacks (they run on torch)."""
    backend = backend or selected()
    if backend == "torch":
        return []
    module = build.load_variant(backend)
    return [op for op, limits in LIMITS.items() if backend in limits and (module is None or not hasattr(module, op))]


def native_bf16_matmul(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU has bf16 dot products (``avx512_bf16`` or ``amx_bf16``), i.e. whether PyTorch's bf16
    matmul (oneDNN) is fast; without them it is several times slower than fp32 (docs/modules.md)."""
    if flags is None:
        return _host_native_bf16()
    return "avx512_bf16" in flags or "amx_bf16" in flags


@functools.cache
def _host_native_bf16() -> bool:
    return native_bf16_matmul(build.cpu_flags())


def torch_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which the torch backend multiplies ``dtype`` activations by a dense weight kept for it:
    float32 for bf16 on CPUs without ``native_bf16_matmul``, else ``dtype``."""
    if dtype == torch.bfloat16 and not native_bf16_matmul():
        return torch.float32
    return dtype


@dataclass(frozen=True)
class Status:
    """What the start-up line, ``/metrics`` and ``/version`` report.

    ``backend``: the selected backend; ``slow``: true on ``torch`` or when the variant lacks an operator;
    ``message``: the one start-up line; ``level``: its logging level (WARNING when slow, else INFO).
    """

    backend: str
    slow: bool
    message: str
    level: int


def status() -> Status:
    """The kernel path of this process (loads the selected variant, building it on first use)."""
    backend = selected()
    if backend == "torch":
        reason = build.unsupported_reason() or "the build failed (its error was logged)"
        return Status("torch", True, f"Tandem kernels: torch ({reason}) - {TORCH_COST}", logging.WARNING)
    missing = missing_ops(backend)
    message = f"Tandem kernels: {backend} ({DESCRIPTIONS[backend]})"
    if missing:
        message += f"; {', '.join(missing)} not built for {backend} yet, run on torch - decode is slower"
        return Status(backend, True, message, logging.WARNING)
    return Status(backend, False, message, logging.INFO)


def log_status(log: logging.Logger | None = None) -> Status:
    """Logs ``status()``'s one line (WARNING when the slow path runs) and returns it."""
    s = status()
    (log or logger).log(s.level, "%s", s.message)
    return s


def candidates(requested: str, flags: frozenset[str]) -> list[str]:
    """The variants ``requested`` (``auto``, a variant name, or ``torch``) may load on a CPU with ``flags``,
    in order of preference (``auto``: every variant whose flags the CPU has).

    Raises:
        ConfigError: an unknown name, or a variant named explicitly that the CPU cannot run.
    """
    if requested not in KERNEL_BACKENDS:
        raise ConfigError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {requested!r}")
    if requested == "torch":
        return []
    runnable = [n for n, v in build.VARIANTS.items() if all(f in flags for f in v.required_cpu_flags)]
    if requested == "auto":
        return runnable
    if requested not in runnable:
        lacking = [f for f in build.VARIANTS[requested].required_cpu_flags if f not in flags]
        raise ConfigError(f"kernel_backend {requested!r} cannot run here: the CPU lacks {', '.join(lacking)}; "
                          "use 'auto', 'avx2' or 'torch'")
    return [requested]


def configure(kernel_backend: str | None) -> None:
    """Selects the backend of this process before a model is built: ``None`` keeps
    ``$TANDEM_KERNEL_BACKEND`` (``auto`` when unset), a name overrides it.

    Changes: ``os.environ["TANDEM_KERNEL_BACKEND"]`` (so processes started later agree) and the
    cached ``build.selected_variant``; layers already built switch too (they ask on every call).

    Raises:
        ConfigError: an unknown name, or a variant the CPU cannot run (see ``candidates``).
    """
    if kernel_backend is None:
        return
    if build._platform_reason() is None:
        candidates(kernel_backend, build.cpu_flags())
    elif kernel_backend not in KERNEL_BACKENDS:
        raise ConfigError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {kernel_backend!r}")
    if os.environ.get("TANDEM_KERNEL_BACKEND") != kernel_backend:
        os.environ["TANDEM_KERNEL_BACKEND"] = kernel_backend
        build.selected_variant.cache_clear()
