"""Just-in-time build of Tandem's C++ CPU kernels with ``torch.utils.cpp_extension.load``.

The extension is compiled once per machine (about a minute with 2 cores) into
``$TANDEM_KERNEL_CACHE`` (default ``~/.cache/tandem/kernels``), in a folder named after a digest of
the sources, compiler flags, torch and Python versions; later processes import the built library
directly. ``TANDEM_KERNELS=0`` disables the kernels. When the CPU lacks AVX-512 BF16, the platform
is not x86-64 Linux, or the build fails (no compiler, no ninja), ``load_extension`` returns None,
logs one warning, and callers use their PyTorch path.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import sys
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SOURCES = ("bindings.cpp", "linear_bf16.cpp", "linear_quant.cpp", "paged_attention.cpp", "elementwise.cpp",
           "threads.cpp", "decoder_layer.cpp")
HEADERS = ("vec.h", "gemm_tile.h")
CSRC = Path(__file__).resolve().parent / "csrc"
# avx512_bf16 for vdpbf16ps; avx512bw/vl for masked 16-bit loads; dq because -mavx512dq lets the
# compiler use it (every CPU with avx512_bf16 has the other three).
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16")
CFLAGS = ("-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-mf16c")
# NOTE: at::parallel_for is an OpenMP pragma inlined from ATen's headers: without -fopenmp it runs on
# one thread. The library links libgomp.so.1 by soname, so it binds to the copy torch already loaded.
LDFLAGS = ("-fopenmp",)


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


def unsupported_reason() -> str | None:
    """Why the kernels cannot run here, or None when they can."""
    if os.environ.get("TANDEM_KERNELS", "1") == "0":
        return "disabled by TANDEM_KERNELS=0"
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"needs x86-64 Linux, this is {sys.platform} {platform.machine()}"
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    return None


def cache_dir() -> Path:
    """Root of the kernel build folders: ``$TANDEM_KERNEL_CACHE`` or ``~/.cache/tandem/kernels``.

    NOTE: not ``$TANDEM_CACHE``: the test suite points that at a fresh folder per session, which
    would rebuild the kernels on every run; builds are keyed by a digest, so sharing them is safe.
    """
    return Path(os.environ.get("TANDEM_KERNEL_CACHE", Path.home() / ".cache" / "tandem" / "kernels"))


def extension_name() -> str:
    """``tandem_kernels_<digest>``: the digest covers sources, flags, torch and Python versions."""
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update((CSRC / name).read_bytes())
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    h.update(f"{torch.__version__} {sys.version_info[:2]}".encode())
    return f"tandem_kernels_{h.hexdigest()[:12]}"


def _import_built(name: str, build_dir: Path) -> ModuleType | None:
    """Import ``name`` from a previous build in ``build_dir`` without invoking ninja again."""
    path = build_dir / f"{name}.so"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# NOTE: cached because a compiled extension is process-global anyway (one .so loaded once); this
# also makes the "falling back" warning appear once per process.
@functools.cache
def load_extension() -> ModuleType | None:
    """The compiled kernel module, building it on first use; None when unavailable (see module doc)."""
    reason = unsupported_reason()
    if reason is not None:
        logger.info("Tandem CPU kernels not used: %s", reason)
        return None
    name = extension_name()
    build_dir = cache_dir() / name
    try:
        module = _import_built(name, build_dir)
        if module is not None:
            return module
        from torch.utils.cpp_extension import load

        build_dir.mkdir(parents=True, exist_ok=True)
        logger.info("building Tandem CPU kernels into %s (once per machine, about a minute)", build_dir)
        return load(name=name, sources=[str(CSRC / s) for s in SOURCES], extra_cflags=list(CFLAGS),
                    extra_ldflags=list(LDFLAGS), build_directory=str(build_dir), verbose=False)
    except Exception as e:  # NOTE: compiler, ninja or loader errors all mean "use PyTorch"
        logger.warning("Tandem CPU kernels unavailable, falling back to PyTorch ops: %s", e)
        return None
