"""The environment a benchmark ran in, recorded with every `tandem bench` result, and the check
`tandem bench compare` makes before it trusts two results side by side.

Recorded: Tandem's version and git commit (with a dirty flag), Python, the installed distributions
(`pip freeze` equivalent, from importlib.metadata), the command line, `TANDEM_*` / `OMP_*` / `MKL_*`
/ `KMP_*` variables, CPU model, flags and core counts (online and allowed), memory, the kernel path
(the server's `/version` `kernel_backend` when it tells, else this machine's selection), and SHA-256
of the model and tokenizer files found at the given local paths.

Secrets are not recorded: the value of a flag, and of a variable, whose name has a word
key/keys/apikey/secret/token/password/passwd (split at `-` / `_`, any case; `--api-key`,
`TANDEM_KV_SECRET`, but not `--max-tokens`) is stored as `***`; the names stay.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import psutil

_ENV_PREFIXES = ("TANDEM_", "OMP_", "MKL_", "KMP_")
_SECRET_WORDS = frozenset({"key", "keys", "apikey", "secret", "secrets", "token", "password", "passwd"})
REDACTED = "***"
_MODEL_SUFFIXES = (".safetensors", ".gguf", ".bin", ".json", ".model", ".txt", ".jinja")
# Differences in these keys make two results' numbers not comparable (pip and flags are listed apart).
COMPARED_KEYS = ("tandem_version", "git_commit", "git_dirty", "python", "cpu_model", "cpu_count",
                 "cpus_allowed", "memory_bytes", "kernel_backend", "env", "model_files")


def _git(args: list[str]) -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def cpu_info() -> dict[str, Any]:
    """Model name and flags from /proc/cpuinfo (empty where there is none), core counts."""
    model, flags = platform.processor() or None, []
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model in (None, "", platform.machine()):
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = sorted(value.split())
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu_model": model, "cpu_flags": flags, "cpu_count": os.cpu_count(), "cpus_allowed": allowed}


def model_file_hashes(paths: list[str | None]) -> dict[str, str]:
    """{file name: sha256} of the model/tokenizer files at each local path (a file or a folder's
    top level); paths that are not local are skipped."""
    out = {}
    for raw in paths:
        if not raw or not os.path.exists(raw):
            continue
        path = Path(raw)
        files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in _MODEL_SUFFIXES)
        for f in files:
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):  # noqa: B023 - fh is bound per file
                    h.update(block)
            out[f.name] = h.hexdigest()
    return out


def server_kernel_backend(base_url: str | None, headers: dict[str, str] | None = None) -> str | None:
    """The `kernel_backend` of a Tandem server's `/version` (None for other servers or no answer)."""
    if not base_url:
        return None
    try:
        r = httpx.get(base_url.rstrip("/").removesuffix("/v1") + "/version", headers=headers or {}, timeout=5)
        return r.json().get("kernel_backend") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


def is_secret_name(name: str) -> bool:
    """True when a flag or variable name has a secret word (see the module docstring)."""
    return any(w in _SECRET_WORDS for w in re.split(r"[-_]+", name.lower().lstrip("-")))


def redact_argv(argv: list[str]) -> list[str]:
    """The command line with the values of secret flags (`--api-key X`, `--api-key=X`) as `***`."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        flag, eq, _ = arg.partition("=")
        if hide_next and not arg.startswith("--"):
            out.append(REDACTED)
        elif arg.startswith("--") and eq and is_secret_name(flag):
            out.append(f"{flag}={REDACTED}")
        else:
            out.append(arg)
        hide_next = arg.startswith("--") and not eq and is_secret_name(arg)
    return out


def collect_environment(argv: list[str] | None = None, model_paths: list[str | None] | None = None,
                        base_url: str | None = None, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """The environment document stored under `environment` in a saved result."""
    import tandem

    kernel = server_kernel_backend(base_url, headers)
    if kernel is None:
        try:
            from tandem.kernels import registry

            kernel = f"client: {registry.status().backend}"
        except Exception as e:  # NOTE: an environment record must not fail the benchmark that made it
            kernel = f"unknown ({type(e).__name__})"
    pip = sorted({f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()
                  if d.metadata["Name"]}, key=str.lower)
    return {
        "tandem_version": tandem.__version__, "git_commit": _git(["rev-parse", "HEAD"]),
        "git_dirty": bool(_git(["status", "--porcelain", "--untracked-files=no"])),
        "python": sys.version.split()[0], "platform": platform.platform(), "argv": redact_argv(list(argv or sys.argv)),
        "env": {k: REDACTED if is_secret_name(k) else v for k, v in sorted(os.environ.items())
                if k.startswith(_ENV_PREFIXES)},
        **cpu_info(), "memory_bytes": psutil.virtual_memory().total, "kernel_backend": kernel,
        "model_files": model_file_hashes(model_paths or []), "pip_freeze": pip,
    }


def environment_differences(base: dict[str, Any] | None, new: dict[str, Any] | None) -> list[str]:
    """Human lines for each recorded difference between two environments (none when either lacks
    a record: older results are not flagged)."""
    if not base or not new:
        return []
    lines = [f"{k}: {base.get(k)!r} vs {new.get(k)!r}" for k in COMPARED_KEYS if base.get(k) != new.get(k)]
    if base.get("cpu_flags") != new.get("cpu_flags"):
        a, b = set(base.get("cpu_flags") or []), set(new.get("cpu_flags") or [])
        lines.append(f"cpu_flags: only base {sorted(a - b)[:10]}, only new {sorted(b - a)[:10]}")
    old_pip = dict(p.split("==", 1) for p in base.get("pip_freeze") or [] if "==" in p)
    new_pip = dict(p.split("==", 1) for p in new.get("pip_freeze") or [] if "==" in p)
    changed = [f"{n} {old_pip.get(n)} -> {new_pip.get(n)}" for n in sorted(set(old_pip) | set(new_pip))
               if old_pip.get(n) != new_pip.get(n)]
    if changed:
        lines.append(f"packages ({len(changed)}): " + ", ".join(changed[:15]) + (" ..." if len(changed) > 15 else ""))
    return lines
