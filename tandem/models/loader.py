"""Load a Hugging Face checkpoint folder's ``*.safetensors`` weights into a Tandem model.

Files are memory-mapped with ``safetensors.safe_open`` and copied tensor by tensor into parameters
that already have the target dtype, so peak memory is the model plus one tensor. Fused projections
(``Linear.shard_names``) are filled slice by slice from their separate checkpoint tensors.

A folder converted from a GGUF may hold linear layers quantized as they were in the file (config.json
key ``tandem_quantized``, see ``tandem/models/gguf_convert.py``): those modules become
``QuantizedLinear`` before loading and their codes are copied as they are, so no float copy of them is
ever made. A fused projection whose shards are all quantized in one format is one ``QuantizedLinear``; in
several formats (llama.cpp's K-quant mixes), a ``ConcatLinear`` of one per format; when only some of its
shards are quantized, those are dequantized (float32 reference, ``quant.dequantize_weight``) into a float layer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from tandem.attention import AttentionBackend
from tandem.models.hf_config import CheckpointError, HFModelConfig
from tandem.models.layers import Linear
from tandem.models.llama import LlamaForCausalLM
from tandem.models.moe_quant import use_quantized_experts
from tandem.models.quant import ConcatLinear, QuantizedLinear, dequantize_weight
from tandem.models.registry import get_model_class

QUANTIZED_KEY = "tandem_quantized"  # NOTE: gguf_convert.QUANTIZED_KEY; not imported (gguf is heavy)
QUANTIZED_PARTS = ("qweight", "scale")

INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class _Target:
    """One checkpoint tensor and the rows ``[start, end)`` of the parameter it fills."""

    name: str
    param: torch.Tensor
    start: int
    end: int

    @property
    def expected_shape(self) -> tuple[int, ...]:
        return (self.end - self.start, *self.param.shape[1:])


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file holding it.

    Uses ``model.safetensors.index.json`` when present (sharded checkpoints), else reads the
    headers of every ``*.safetensors`` file in the folder.

    Raises:
        FileNotFoundError: no safetensors weights in ``model_dir``, or a shard named by the index
            is missing.
        CheckpointError: the index or a file header cannot be parsed (truncated or corrupt file).
    """
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: cannot read the weight_map ({e!r})") from e
        files = {name: model_dir / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise FileNotFoundError(f"shard {shard.name} listed in {index_path} is missing")
        return files
    paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        others = sorted(p.name for pattern in ("*.bin", "*.pt", "*.pth") for p in model_dir.glob(pattern))
        hint = f" (found {', '.join(others)}: only safetensors weights are supported)" if others else ""
        raise FileNotFoundError(
            f"no weights in {model_dir}: expected model.safetensors or sharded *.safetensors "
            f"with {INDEX_FILE}{hint}"
        )
    files: dict[str, Path] = {}
    for path in paths:
        with _open(path) as f:
            files.update(dict.fromkeys(f.keys(), path))
    return files


def _open(path: Path):  # noqa: ANN202 (safetensors' handle type is not public)
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # NOTE: safetensors raises its own SafetensorError plus OSError variants
        raise CheckpointError(
            f"{path}: cannot read safetensors file, it may be truncated or corrupt ({e})"
        ) from e


def quantized_modules(model_dir: Path) -> dict[str, str]:
    """``{checkpoint module name: QuantizedLinear format}`` from config.json's ``tandem_quantized``.

    Raises:
        CheckpointError: the entry has another version or is malformed.
    """
    config = json.loads((Path(model_dir) / "config.json").read_text())
    entry = config.get(QUANTIZED_KEY)
    if entry is None:
        return {}
    if not isinstance(entry, dict) or entry.get("version") != 1 or not isinstance(entry.get("modules"), dict):
        raise CheckpointError(f"{model_dir}/config.json: unsupported {QUANTIZED_KEY} entry {entry!r}")
    return dict(entry["modules"])


def _shard_names(name: str, module: Linear | QuantizedLinear) -> list[str]:
    """Checkpoint module names of a (possibly fused) linear layer named ``name`` in the model."""
    parent = name.rpartition(".")[0]
    return [f"{parent}.{shard}" if parent else shard for shard in module.shard_names] or [name]


def use_quantized_modules(model: torch.nn.Module, formats: dict[str, str]) -> None:
    """Replace each ``Linear`` whose checkpoint shards are all stored in one quantized format, and the experts of
    each MoE block stored as codes (``moe_quant.use_quantized_experts``).

    Changes: ``model``'s modules in place (new, uninitialized ``QuantizedLinear`` / ``ConcatLinear`` modules;
    a tied LM head stops sharing the embedding table). Layers with some shards not quantized stay float.
    """
    use_quantized_experts(model, formats)
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear):
            continue
        shard_formats = [formats.get(shard) for shard in _shard_names(name, module)]
        if None in shard_formats:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        args = (module.weight.shape[1], module.output_sizes, module.bias is not None, module.weight.dtype,
                module.shard_names)
        if len(set(shard_formats)) == 1:
            setattr(parent, attr, QuantizedLinear.empty(shard_formats[0], *args))
        else:
            setattr(parent, attr, ConcatLinear.empty(shard_formats, *args))


def _hooked_targets(model: torch.nn.Module, files: dict[str, Path]) -> tuple[list[_Target], set[str]]:
    """Targets of modules that name their own checkpoint tensors (``checkpoint_targets``, e.g. the MoE
    blocks of ``models/moe.py``), and the names of the parameters they cover.

    Of each module's alternatives the first whose tensors are all in ``files`` is taken; when none is
    complete the first is returned, so the missing-tensor error names what was expected.
    """
    targets: list[_Target] = []
    covered: set[str] = set()
    for name, module in model.named_modules():
        if not hasattr(module, "checkpoint_targets"):
            continue
        alternatives = module.checkpoint_targets(name)
        chosen = next((a for a in alternatives if all(t in files for t, _ in a)), alternatives[0])
        targets += [_Target(t, view, 0, view.shape[0]) for t, view in chosen]
        storages = {view.untyped_storage().data_ptr() for _, view in chosen}
        covered |= {f"{name}.{p}" if name else p for p, tensor in module.named_parameters()
                    if tensor.untyped_storage().data_ptr() in storages}
    return targets, covered


def _checkpoint_parent(module_name: str, concat: set[str]) -> str:
    """The checkpoint prefix of a fused layer's shards: its parent module, or for a part of a ``ConcatLinear``
    (``<p>.qkv_proj.parts.<i>``) the ConcatLinear's parent ``<p>``."""
    parent = module_name.rpartition(".")[0]
    head = parent.rpartition(".")[0]
    return head.rpartition(".")[0] if head in concat else parent


def _targets(model: torch.nn.Module, files: dict[str, Path] | None = None) -> list[_Target]:
    """Every checkpoint tensor the model needs; shared (tied) parameters appear once."""
    targets, covered = _hooked_targets(model, files or {})
    concat = {name for name, m in model.named_modules() if isinstance(m, ConcatLinear)}
    quantized = [
        (f"{name}.{leaf}", buf) for name, m in model.named_modules() if isinstance(m, QuantizedLinear)
        for leaf, buf in m.named_buffers(recurse=False) if leaf in QUANTIZED_PARTS
    ]
    for param_name, param in [*model.named_parameters(), *quantized]:
        if param_name in covered:
            continue
        module_name, _, leaf = param_name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, Linear | QuantizedLinear) and module.shard_names:
            parent = _checkpoint_parent(module_name, concat)
            start = 0
            for shard, size in zip(module.shard_names, module.output_sizes, strict=True):
                targets.append(_Target(f"{parent}.{shard}.{leaf}", param, start, start + size))
                start += size
        else:
            targets.append(_Target(param_name, param, 0, param.shape[0]))
    return targets


def load_weights(model: torch.nn.Module, model_dir: Path, progress: bool = True) -> None:
    """Copy the checkpoint in ``model_dir`` into ``model``'s parameters, casting to their dtype.

    Changes: every parameter of ``model`` (in place). Extra checkpoint tensors (e.g. old
    ``rotary_emb.inv_freq`` buffers) are ignored. A tqdm bar counts tensors when ``progress``.

    Raises:
        FileNotFoundError: see ``checkpoint_files``.
        CheckpointError: a tensor is missing (names it and the files searched), has the wrong
            shape (names it, the file, the expected and found shapes), or a file cannot be read.
    """
    files = checkpoint_files(model_dir)
    targets = _targets(model, files)
    missing = [t.name for t in targets if t.name not in files and _qweight_name(t.name) not in files]
    if missing:
        searched = ", ".join(sorted({p.name for p in files.values()}))
        shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise CheckpointError(f"missing tensor(s) {shown} in {model_dir} (searched {searched})")
    formats = quantized_modules(model_dir)
    by_file: dict[Path, list[_Target]] = {}
    for t in targets:
        by_file.setdefault(files.get(t.name) or files[_qweight_name(t.name)], []).append(t)
    with tqdm(total=len(targets), desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for path, group in by_file.items():
            with _open(path) as f:
                for t in group:
                    _copy_tensor(f, path, t, formats)
                    bar.update(1)


def _qweight_name(name: str) -> str:
    return name.removesuffix(".weight") + ".qweight" if name.endswith(".weight") else ""


def _dequantized_shard(f, name: str, formats: dict[str, str]) -> torch.Tensor:  # noqa: ANN001
    """The float32 weight of checkpoint module ``name`` stored quantized (a shard of a mixed projection)."""
    module = name.removesuffix(".weight")
    parts = {p: f.get_tensor(f"{module}.{p}") for p in QUANTIZED_PARTS if f"{module}.{p}" in f.keys()}
    return dequantize_weight(formats[module], parts["qweight"], parts["scale"])


def _copy_tensor(f, path: Path, t: _Target, formats: dict[str, str] | None = None) -> None:  # noqa: ANN001
    try:
        quantized = t.name not in f.keys()  # then ``_qweight_name(t.name)`` is (checked by load_weights)
        tensor = _dequantized_shard(f, t.name, formats or {}) if quantized else None
        shape = tuple(tensor.shape) if quantized else tuple(f.get_slice(t.name).get_shape())
        if shape != t.expected_shape:
            raise CheckpointError(
                f"tensor {t.name} in {path.name} has shape {list(shape)}, expected {list(t.expected_shape)}"
            )
        tensor = tensor if quantized else f.get_tensor(t.name)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read tensor {t.name}, the file may be corrupt ({e})") from e
    with torch.no_grad():
        t.param[t.start : t.end].copy_(tensor)


def load_model(
    model_dir: Path,
    cfg: HFModelConfig,
    dtype: str | torch.dtype = "bfloat16",
    max_positions: int | None = None,
    backend: AttentionBackend | None = None,
    progress: bool = True,
) -> LlamaForCausalLM:
    """Build the model class registered for ``cfg.architecture`` and load its weights.

    ``max_positions`` sizes the RoPE tables (default ``cfg.max_model_len``). Returns the model in
    eval mode with ``requires_grad`` off.

    Raises:
        CheckpointError / FileNotFoundError: see ``load_weights``; ValueError for an unknown dtype.
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    model_cls = get_model_class(cfg.architecture)
    model = model_cls(cfg, dtype, max_positions or cfg.max_model_len, backend)
    use_quantized_modules(model, quantized_modules(model_dir))
    load_weights(model, model_dir, progress=progress)
    return model.eval()
