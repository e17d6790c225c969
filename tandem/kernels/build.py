"""Just-in-time build of Tandem's C++ CPU kernels with ``torch.utils.cpp_extension.load``.

There is one build per instruction set (a ``Variant``): ``avx512_bf16`` (Zen 4/5, Sapphire Rapids:
``vdpbf16ps``, VNNI) and ``avx2`` (AVX2 + FMA + F16C: every x86-64 server since Haswell / Zen 1).
Each is compiled with only its own ISA flags, so both build on any x86-64 machine, and the one the
CPU runs is chosen at run time (``selected_variant``: ``$TANDEM_KERNEL_BACKEND`` = ``auto`` |
``avx512_bf16`` | ``avx2`` | ``torch``; ``auto`` takes the first in ``VARIANTS`` the CPU has).
A variant is compiled once per machine (about a minute with 2 cores) into ``$TANDEM_KERNEL_CACHE``
(default ``~/.cache/tandem/kernels``), in a folder named after a digest of its sources, compiler
flags, torch and Python versions; later processes import the built library directly.
``TANDEM_KERNELS=0`` disables every variant. When no variant can run (CPU flags, not x86-64 Linux,
the build fails), ``load_extension`` returns None, logs one warning, and callers use PyTorch ops.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
# NOTE: at::parallel_for is an OpenMP pragma inlined from ATen's headers: without -fopenmp it runs on
# one thread. The library links libgomp.so.1 by soname, so it binds to the copy torch already loaded.
LDFLAGS = ("-fopenmp",)


@dataclass(frozen=True)
class Variant:
    """One build of the kernels for one instruction set.

    Attributes:
        name: the backend name (``avx512_bf16``, ``avx2``), also ``--kernel-backend``'s value.
        sources: ``.cpp`` files relative to ``csrc/``.
        headers: headers relative to ``csrc/`` (hashed into the build digest).
        cflags: compiler flags; each variant gets only the ISA flags it needs, so every variant can
            be compiled on any x86-64 machine and the one the CPU runs is chosen at run time.
        required_cpu_flags: ``/proc/cpuinfo`` flags the CPU needs to run this build.
        ldflags: linker flags.
    """

    name: str
    sources: tuple[str, ...]
    headers: tuple[str, ...]
    cflags: tuple[str, ...]
    required_cpu_flags: tuple[str, ...]
    ldflags: tuple[str, ...] = LDFLAGS


def _avx2_files(suffix: str) -> tuple[str, ...]:
    return tuple(sorted(f"avx2/{p.name}" for p in (CSRC / "avx2").glob(f"*{suffix}")))


# avx512_bf16 for vdpbf16ps; avx512bw/vl for masked 16-bit loads; dq because -mavx512dq lets the
# compiler use it (every CPU with avx512_bf16 has the other three).
AVX512_BF16 = Variant(
    name="avx512_bf16",
    sources=("bindings.cpp", "linear_bf16.cpp", "linear_bf16_packed.cpp", "linear_quant.cpp", "paged_attention.cpp",
             "elementwise.cpp", "threads.cpp", "decoder_layer.cpp", "avx2/parallel.cpp"),
    headers=("vec.h", "gemm_tile.h", "packed_bf16.h", "avx2/parallel.h"),
    cflags=("-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma",
            "-mf16c"),
    required_cpu_flags=("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
    # NOTE: both variants now hold the worker team (avx2/parallel.cpp); each binds to its own copy
    ldflags=LDFLAGS + ("-Wl,-Bsymbolic",),
)
# Haswell / Zen 1 and later: 256-bit FMA, fp16 conversions; bf16 is widened to fp32 in registers.
# NOTE: -Bsymbolic binds the library's calls to its own definitions even if another variant with the
# same function names is loaded in the process (tests load both on AVX-512 machines).
AVX2 = Variant(
    name="avx2",
    sources=_avx2_files(".cpp") + ("threads.cpp", "decoder_layer.cpp"),
    headers=_avx2_files(".h") + ("packed_bf16.h",),
    cflags=("-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"),
    required_cpu_flags=("avx2", "fma", "f16c"),
    ldflags=LDFLAGS + ("-Wl,-Bsymbolic",),
)
# In order of preference: "auto" picks the first the CPU can run.
VARIANTS: dict[str, Variant] = {v.name: v for v in (AVX512_BF16, AVX2)}
BACKENDS = ("auto", *VARIANTS, "torch")

# Kept for callers of the single-variant API.
SOURCES, HEADERS, CFLAGS = AVX512_BF16.sources, AVX512_BF16.headers, AVX512_BF16.cflags
REQUIRED_CPU_FLAGS = AVX512_BF16.required_cpu_flags


def cpu_flags() -> frozenset[str]:
    """The ``flags`` of the first CPU in ``/proc/cpuinfo`` (empty where that file does not exist)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _platform_reason() -> str | None:
    if os.environ.get("TANDEM_KERNELS", "1") == "0":
        return "disabled by TANDEM_KERNELS=0"
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"needs x86-64 Linux, this is {sys.platform} {platform.machine()}"
    return None


def variant_unsupported_reason(name: str) -> str | None:
    """Why variant ``name`` cannot run here (platform, ``TANDEM_KERNELS=0``, CPU flags), or None.

    Raises:
        KeyError: ``name`` is not a variant.
    """
    variant = VARIANTS[name]
    reason = _platform_reason()
    if reason is not None:
        return reason
    missing = [f for f in variant.required_cpu_flags if f not in cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    return None


def requested_backend() -> str:
    """``$TANDEM_KERNEL_BACKEND`` (``auto`` when unset): ``auto``, a variant name, or ``torch``.

    Raises:
        ValueError: an unknown name.
    """
    name = os.environ.get("TANDEM_KERNEL_BACKEND", "auto").strip() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"TANDEM_KERNEL_BACKEND={name!r}: expected one of {', '.join(BACKENDS)}")
    return name


def unsupported_reason() -> str | None:
    """Why no compiled variant can run here, or None when one can (the selected one, see ``selected_variant``)."""
    reason = _platform_reason()
    if reason is not None:
        return reason
    requested = requested_backend()
    if requested == "torch":
        return "the torch backend was requested: TANDEM_KERNEL_BACKEND=torch or --kernel-backend torch"
    names = list(VARIANTS) if requested == "auto" else [requested]
    reasons = {n: variant_unsupported_reason(n) for n in names}
    if any(r is None for r in reasons.values()):
        return None
    return "; ".join(f"{n}: {r}" for n, r in reasons.items())


def cache_dir() -> Path:
    """Root of the kernel build folders: ``$TANDEM_KERNEL_CACHE`` or ``~/.cache/tandem/kernels``.

    NOTE: not ``$TANDEM_CACHE``: the test suite points that at a fresh folder per session, which
    would rebuild the kernels on every run; builds are keyed by a digest, so sharing them is safe.
    """
    return Path(os.environ.get("TANDEM_KERNEL_CACHE", Path.home() / ".cache" / "tandem" / "kernels"))


def extension_name(variant: str = "avx512_bf16") -> str:
    """``tandem_kernels_<variant>_<digest>``: the digest covers sources, flags, torch and Python versions."""
    v = VARIANTS[variant]
    h = hashlib.sha256()
    for name in v.sources + v.headers:
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    h.update(" ".join(v.cflags + v.ldflags).encode())
    h.update(f"{torch.__version__} {sys.version_info[:2]}".encode())
    return f"tandem_kernels_{variant}_{h.hexdigest()[:12]}"


def _import_built(name: str, build_dir: Path) -> ModuleType | None:
    """Import ``name`` from a previous build in ``build_dir`` without invoking ninja again."""
    path = build_dir / f"{name}.so"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Holds an exclusive ``flock`` on ``build_dir/.tandem-build.lock`` while one process builds.

    NOTE: torch's own baton (a ``lock`` file it creates and deletes) is never removed when a build is
    killed (Ctrl-C on the first start), and every later start then waits on it forever. A ``flock``
    is released by the kernel when its holder dies, so while we hold it any ``lock`` file is stale.
    """
    with open(build_dir / ".tandem-build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# NOTE: cached because a compiled extension is process-global anyway (one .so loaded once); this
# also makes the "falling back" warning appear once per process and variant.
@functools.cache
def load_variant(variant: str) -> ModuleType | None:
    """The compiled module of one variant, building it on first use; None when the CPU cannot run it
    or the build fails (logged once as a warning).

    Raises:
        KeyError: ``variant`` is not a variant name.
    """
    reason = variant_unsupported_reason(variant)
    if reason is not None:
        logger.info("Tandem %s kernels not used: %s", variant, reason)
        return None
    v = VARIANTS[variant]
    name = extension_name(variant)
    build_dir = cache_dir() / name
    try:
        module = _import_built(name, build_dir)
        if module is not None:
            return module
        build_dir.mkdir(parents=True, exist_ok=True)
        with _build_lock(build_dir):
            module = _import_built(name, build_dir)  # another process may have built it meanwhile
            if module is not None:
                return module
            from torch.utils.cpp_extension import load

            logger.warning("building Tandem %s CPU kernels into %s (once per machine, about a minute)",
                           variant, build_dir)
            return load(name=name, sources=[str(CSRC / s) for s in v.sources], extra_cflags=list(v.cflags),
                        extra_ldflags=list(v.ldflags), build_directory=str(build_dir), verbose=False)
    except Exception as e:  # NOTE: compiler, ninja or loader errors all mean "use another backend"
        logger.warning("Tandem %s CPU kernels unavailable: %s", variant, e)
        return None


@functools.cache
def selected_variant() -> str | None:
    """The variant ``tandem.kernels`` uses: the requested one, or with ``auto`` the first in
    ``VARIANTS`` the CPU runs and that builds; None means the torch backend."""
    if _platform_reason() is not None:
        return None
    requested = requested_backend()
    if requested == "torch":
        return None
    for name in (VARIANTS if requested == "auto" else [requested]):
        if load_variant(name) is not None:
            return name
    return None


def load_extension() -> ModuleType | None:
    """The compiled module of ``selected_variant()`` (built on first use), or None (see module doc)."""
    name = selected_variant()
    return load_variant(name) if name is not None else None
