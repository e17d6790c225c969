"""Convert a llama.cpp GGUF file into a Hugging Face checkpoint folder.

The folder holds `config.json`, `model.safetensors`, `tokenizer.json`, `tokenizer_config.json` and
`generation_config.json`, so Tandem's safetensors loader reads it like any HF checkpoint.

Linear weights in Q8_0, Q4_0, Q4_1, Q5_0, Q4_K or Q6_K are kept as the file's blocks, split into codes and
scales (`tandem/models/quant.py` formats q8_0, int4, q4_1, q5_0, q4_k, q6_k; layouts in
`tandem/models/gguf_blocks.py`): `<module>.qweight` and `<module>.scale` (for Q4_1 / Q4_K the (d, m) /
(d, dmin) pairs) instead of `<module>.weight`; config.json lists them under `QUANTIZED_KEY`
(`{"version": 1, "modules": {hf module name: format}}`) and the loader builds `QuantizedLinear` modules
from them. A tied LM head whose embedding table is in a kept type gets its own `lm_head.*` codes from
the table's blocks (the decode step reads the head's bytes once per token; the table itself is stored
dequantized for lookups). Other block types (Q5_1, Q5_K, Q2_K, IQ*, ...) and embedding tables are dequantized to
F32 (exact); F32/F16/BF16 tensors are copied in their own dtype. With `keep_quantized=False` every
block type is dequantized, which transformers can read too.

Sources: the GGUF spec (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md); llama.cpp's
`convert_hf_to_gguf.py` (metadata keys, tensor names, the Q/K row permutation of `LlamaModel.permute`,
the llama3 `rope_freqs` tensor); gguf-py for reading and dequantizing blocks; transformers for rebuilding
the tokenizer from GGUF metadata.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from tqdm.auto import tqdm

from tandem.models import gguf_families, gguf_moe
from tandem.models.gguf_blocks import LAYOUTS, block_shapes
from tandem.models.gguf_config import (  # noqa: F401 (re-exported: the converter's public names)
    SUPPORTED_ARCHITECTURES,
    UnsupportedGGUFError,
    build_hf_config,
    check_architecture,
    llama3_rope_factors,
    read_metadata,
    special_token_ids,
)

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TENSOR_NAME = re.compile(r"(?:blk\.(?P<layer>\d+)\.)?(?P<base>\w+)\.(?P<suffix>weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"
# GGUF types copied as they are, with their safetensors dtype; every other type is dequantized to F32.
_KEPT_TYPES = {
    GGMLQuantizationType.F32: "F32",
    GGMLQuantizationType.F16: "F16",
    GGMLQuantizationType.BF16: "BF16",
}
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1}
_TORCH_DTYPE = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# config.json key listing the linear layers stored quantized (read by tandem.models.loader).
QUANTIZED_KEY = "tandem_quantized"
QUANTIZED_VERSION = 1
# Block types kept as they are -> QuantizedLinear format (block layouts: tandem/models/gguf_blocks.py).
# Merged expert tensors kept as codes when a layer's three are all of one of these (the fused MoE kernel's
# formats, ``kernels.moe_q8_0`` / ``moe_int4``), or when gate and up share one of the K-quant ones and down is
# in either (``kernels.moe_kquant``: llama.cpp's Q4_K_M mixes); the others are dequantized.
KEPT_EXPERT_BLOCKS = (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0)
KEPT_EXPERT_KQUANTS = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K)
_KEPT_BLOCKS = {
    GGMLQuantizationType.Q8_0: "q8_0",
    GGMLQuantizationType.Q4_0: "int4",
    GGMLQuantizationType.Q4_1: "q4_1",
    GGMLQuantizationType.Q5_0: "q5_0",
    GGMLQuantizationType.Q4_K: "q4_k",
    GGMLQuantizationType.Q6_K: "q6_k",
}
# GGUF tensors that are linear layers' weights (the embedding table is not: a lookup reads one row).
_LINEAR_BASES = frozenset(
    {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output"}
) | gguf_families.LINEAR_BASES



class CorruptGGUFError(ValueError):
    """A file that is not a complete, readable GGUF file (truncated, corrupt or another format)."""


@dataclass(frozen=True)
class _Entry:
    """One output tensor: where it comes from in the GGUF and how it is stored in safetensors."""

    hf_name: str
    tensor: ReaderTensor
    dtype: str  # safetensors dtype: F32, F16, BF16, or I8/U8 for quantized codes
    shape: tuple[int, ...]  # HF (row-major) shape, the reverse of GGUF's ne[] order
    permute_heads: int | None  # undo llama.cpp's Q/K row permutation over this many heads
    part: str = "weight"  # "weight" (float), or "qweight" / "scale" of a kept block tensor
    shift: float = 0.0  # added in float32 after loading (Gemma's norms: -1, see gguf_families)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]


def hf_tensor_name(gguf_name: str, model_type: str = "llama") -> str:
    """Map a GGUF tensor name (`blk.3.attn_q.weight`) to its HF name (`model.layers.3.self_attn.q_proj...`).

    `model_type` (the HF one) names the mixture-of-experts tensors (`gguf_moe.block_tensor_name`).

    Raises:
        UnsupportedGGUFError: the name is not one of the supported architectures' tensors.
    """
    match = _TENSOR_NAME.fullmatch(gguf_name)
    layer, base = (match["layer"], match["base"]) if match else (None, "")
    if match and layer is None and base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{match['suffix']}"
    moe_name = gguf_moe.block_tensor_name(base, model_type) if match and layer is not None else None
    if moe_name is not None:
        return f"model.layers.{layer}.{moe_name}"
    family_name = gguf_families.block_tensor_name(base, model_type) if match and layer is not None else None
    if family_name is not None:
        return f"model.layers.{layer}.{family_name}.{match['suffix']}"
    if match and layer is not None and base in _BLOCK_TENSORS:
        return f"model.layers.{layer}.{_BLOCK_TENSORS[base]}.{match['suffix']}"
    raise UnsupportedGGUFError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent in this converter")


def unpermute_qk(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's `LlamaModel.permute` on q/k_proj rows (weight or bias): (n_heads * head_dim, ...).

    llama.cpp interleaves each head's two rotary halves (GPT-J style); HF Llama uses rotate-half, so row
    `2 * i + j` of a head goes back to row `j * head_dim / 2 + i`.
    """
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _hf_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    # NOTE: GGUF lists dimensions innermost first (ne[0] = row length); HF/numpy list them outermost first.
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


def _block_shapes(fmt: str, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """`block_shapes` of a 2-D `[n, k]` or a merged 3-D `[E, n, k]` (experts) tensor."""
    *lead, k = shape
    shapes = block_shapes(fmt, math.prod(lead), k)
    return {part: ((*lead, *dims[1:]), dtype) for part, (dims, dtype) in shapes.items()}


def _quantized_entries(module: str, tensor: ReaderTensor, permute_heads: int | None) -> list[_Entry]:
    """The codes and scales of a kept block tensor (`_KEPT_BLOCKS`), named after the HF `module`."""
    fmt = _KEPT_BLOCKS[tensor.tensor_type]
    shapes = _block_shapes(fmt, _hf_shape(tensor))
    dtypes = {torch.int8: "I8", torch.uint8: "U8", torch.float16: "F16"}
    return [_Entry(f"{module}.{part}", tensor, dtypes[dtype], shape, permute_heads, part)
            for part, (shape, dtype) in shapes.items()]


def _kept_expert_layers(tensors: list[ReaderTensor]) -> set[str]:
    """The `blk.N` whose merged experts (`ffn_{gate,up,down}_exps`) are all in one of `KEPT_EXPERT_BLOCKS`, or
    gate and up in one of `KEPT_EXPERT_KQUANTS` and down in either: kept as codes for the fused MoE kernels
    (`models/moe_quant.py`); other layers' experts are dequantized."""
    types: dict[str, dict[str, GGMLQuantizationType]] = {}
    for tensor in tensors:
        base = tensor.name.split(".")[-2]
        if base in gguf_moe.EXPERT_BASES:
            types.setdefault(tensor.name.rsplit(".", 2)[0], {})[base] = tensor.tensor_type
    kept = set()
    for blk, kinds in types.items():
        gate, up, down = (kinds.get(f"ffn_{p}_exps") for p in ("gate", "up", "down"))
        if gate == up == down and gate in KEPT_EXPERT_BLOCKS:
            kept.add(blk)
        elif gate == up and gate in KEPT_EXPERT_KQUANTS and down in KEPT_EXPERT_KQUANTS:
            kept.add(blk)
    return kept


def _plan(
    tensors: list[ReaderTensor], config: dict[str, Any], keep_quantized: bool = True
) -> tuple[list[_Entry], dict[str, str]]:
    """One `_Entry` per output tensor, and the quantized modules ({HF module name: format}).

    `rope_freqs` is consumed by the config and not written.
    """
    permute = config["model_type"] in gguf_moe.PERMUTED_QK
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    entries, quantized = [], {}
    kept_experts = _kept_expert_layers(tensors) if keep_quantized else set()
    for tensor in tensors:
        if tensor.name == _ROPE_FREQS or tensor.name in gguf_families.ROPE_FACTOR_TENSORS:
            continue
        base = tensor.name.split(".")[-2]
        hf_name = hf_tensor_name(tensor.name, config["model_type"])
        permute_heads = heads.get(base) if permute else None
        if base in gguf_moe.EXPERT_BASES and tensor.name.rsplit(".", 2)[0] in kept_experts:
            entries += _quantized_entries(hf_name, tensor, None)
            quantized[hf_name] = _KEPT_BLOCKS[tensor.tensor_type]
            continue
        kept = keep_quantized and tensor.tensor_type in _KEPT_BLOCKS and len(tensor.shape) == 2
        if kept and (base in _LINEAR_BASES or base in gguf_moe.SHARED_LINEAR_BASES) and tensor.name.endswith(".weight"):
            module = hf_name.removesuffix(".weight")
            entries += _quantized_entries(module, tensor, permute_heads)
            quantized[module] = _KEPT_BLOCKS[tensor.tensor_type]
            continue
        if kept and base == "token_embd" and config["tie_word_embeddings"]:
            # NOTE: the tied head keeps the table's codes (read whole every decode step); the table is
            # dequantized below for lookups, at the cost of a second, smaller copy.
            entries += _quantized_entries("lm_head", tensor, None)
            quantized["lm_head"] = _KEPT_BLOCKS[tensor.tensor_type]
        shift = gguf_families.norm_shift(config["model_type"], hf_name)
        dtype = "F32" if shift else _KEPT_TYPES.get(tensor.tensor_type, "F32")
        shape = _hf_shape(tensor)
        if base == "ffn_gate_inp_shexp" and len(shape) == 1:
            shape = (1, *shape)  # a 1-row linear layer, whichever way the file stores it
        entries.append(_Entry(hf_name, tensor, dtype, shape, permute_heads, shift=shift))
    return entries, quantized


def load_tensor(tensor: ReaderTensor) -> np.ndarray:
    """A GGUF tensor in HF shape: F32/F16 as stored, BF16 as raw uint16 bits, block types dequantized to F32.

    Raises:
        UnsupportedGGUFError: gguf-py cannot dequantize this block type.
    """
    shape = _hf_shape(tensor)
    if tensor.tensor_type == GGMLQuantizationType.BF16:
        return tensor.data.view(np.uint16).reshape(shape)
    if tensor.tensor_type in _KEPT_TYPES:
        return tensor.data.reshape(shape)
    try:
        return dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    except NotImplementedError as exc:
        raise UnsupportedGGUFError(
            f"GGUF tensor {tensor.name!r} uses block type {tensor.tensor_type.name}, "
            "which gguf-py cannot dequantize"
        ) from exc


def block_parts(tensor: ReaderTensor) -> dict[str, np.ndarray]:
    """A kept block tensor (`_KEPT_BLOCKS`) split into HF-shaped arrays, bit for bit (no arithmetic).

    Returns `qweight` (each block's bytes but its fp16 fields, in file order; Q8_0: int8 [N, K]; Q4_0/Q4_1:
    uint8 [N, K/2], byte j of a block holding weights j and j + 16 in its low and high nibble) and `scale`
    (the fp16 fields, [N, blocks]; Q4_1's (d, m) and Q4_K's (d, dmin) as [N, blocks, 2], kept together so a
    row's kernel reads one stream of them). Layouts (ggml-common.h): `tandem/models/gguf_blocks.py`.
    """
    fmt = _KEPT_BLOCKS[tensor.tensor_type]
    layout = LAYOUTS[fmt]
    *lead, k = _hf_shape(tensor)
    n = math.prod(lead)  # NOTE: merged experts [E, N, K] are split as E * N rows, then reshaped
    shapes = _block_shapes(fmt, _hf_shape(tensor))
    blocks = np.asarray(tensor.data).view(np.uint8).reshape(n, k // layout.values, layout.nbytes)
    scale = blocks[..., slice(*layout.scale)].copy().view(np.float16)
    codes = blocks[..., slice(*layout.codes)].copy()
    return {"scale": scale.reshape(shapes["scale"][0]),
            "qweight": (codes.view(np.int8) if fmt == "q8_0" else codes).reshape(shapes["qweight"][0])}


def _load_entry(entry: _Entry) -> np.ndarray:
    array = load_tensor(entry.tensor) if entry.part == "weight" else block_parts(entry.tensor)[entry.part]
    if entry.permute_heads is not None:
        array = unpermute_qk(array, entry.permute_heads)
    if entry.shift:
        array = _as_float32(array, entry.tensor) + np.float32(entry.shift)
    return np.ascontiguousarray(array).reshape(entry.shape)


def _as_float32(array: np.ndarray, tensor: ReaderTensor) -> np.ndarray:
    """`load_tensor`'s array as float32 (BF16 comes back as raw uint16 bits)."""
    if tensor.tensor_type == GGMLQuantizationType.BF16:
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


def write_safetensors(path: Path, entries: list[_Entry], *, progress: bool = True, desc: str = "") -> None:
    """Stream tensors into one safetensors file, holding one dequantized tensor in memory at a time.

    Format (https://github.com/huggingface/safetensors#format): u64 little-endian header length, a JSON
    header of `{name: {dtype, shape, data_offsets}}` padded with spaces to 8 bytes, then the raw bytes.
    NOTE: `safetensors.torch.save_file` needs every tensor in memory at once; a 7B GGUF dequantized to
    float32 is 28 GB, so we write the header from the planned shapes and the data tensor by tensor.
    """
    # NOTE: offsets must be contiguous (no padding), so wider dtypes go first to keep every tensor aligned.
    entries = sorted(entries, key=lambda e: (-_ITEMSIZE[e.dtype], e.hf_name))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        header[entry.hf_name] = {
            "dtype": entry.dtype,
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for entry in tqdm(entries, desc=desc or f"Writing {path.name}", unit="tensor", disable=not progress):
            array = _load_entry(entry)
            assert array.shape == entry.shape and array.nbytes == entry.nbytes, entry.hf_name
            f.write(array.data)


def _checkpoint_dtype(entries: list[_Entry]) -> str:
    """`torch_dtype` of the checkpoint: the float matrices' dtype if all share one, else float32."""
    dtypes = {e.dtype for e in entries if len(e.shape) == 2 and e.part == "weight"}
    return _TORCH_DTYPE[dtypes.pop()] if len(dtypes) == 1 else "float32"


def _write_tokenizer(gguf_path: Path, out_dir: Path, chat_template: str | None) -> None:
    """tokenizer.json + tokenizer_config.json rebuilt by transformers from the GGUF tokenizer metadata."""
    from transformers import AutoTokenizer  # NOTE: imported here; transformers takes seconds to import

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    # NOTE: save_jinja_files=False keeps the chat template inside tokenizer_config.json.
    tokenizer.save_pretrained(str(out_dir), save_jinja_files=False)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def convert_gguf(
    gguf_path: str | Path, out_dir: str | Path, *, progress: bool = True, keep_quantized: bool = True
) -> Path:
    """Write an HF checkpoint folder for a GGUF file into `out_dir` (created if missing); return `out_dir`.

    Writes config.json, model.safetensors (F32/F16/BF16 kept; `_KEPT_BLOCKS` linear weights as codes and
    scales when `keep_quantized`, see the module docstring; other block types dequantized to float32),
    generation_config.json, tokenizer.json and tokenizer_config.json (with `tokenizer.chat_template`).
    Not atomic: `tandem.models.resolve` converts into a temporary folder and renames it.

    Raises:
        UnsupportedGGUFError: unsupported architecture, tensor name, rope scaling or block type, or missing
            metadata (tokenizer or a required model key).
        CorruptGGUFError: the file is truncated or not a GGUF file.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    try:
        reader = GGUFReader(gguf_path)
    except (ValueError, OSError, IndexError, KeyError) as e:
        # NOTE: gguf-py reports a truncated or foreign file as a bare reshape/magic error; name the file.
        raise CorruptGGUFError(
            f"{gguf_path} is not a readable GGUF file (expected a complete llama.cpp GGUF v2/v3 file: "
            f"truncated download or wrong format?): {e}"
        ) from e
    meta = read_metadata(reader)
    check_architecture(meta)
    if "tokenizer.ggml.model" not in meta:
        raise UnsupportedGGUFError(f"GGUF file {gguf_path} has no tokenizer metadata (tokenizer.ggml.model)")
    tensors = {t.name: t for t in reader.tensors}
    shapes = {name: _hf_shape(t) for name, t in tensors.items()}
    rope_freqs = load_tensor(tensors[_ROPE_FREQS]).astype(np.float32) if _ROPE_FREQS in tensors else None
    rope_factors = {name: load_tensor(tensors[name]).astype(np.float32)
                    for name in gguf_families.ROPE_FACTOR_TENSORS if name in tensors}
    config = build_hf_config(meta, shapes, rope_freqs, rope_factors)
    entries, quantized = _plan(list(tensors.values()), config, keep_quantized)
    config["torch_dtype"] = config["dtype"] = _checkpoint_dtype(entries)
    if quantized:
        config[QUANTIZED_KEY] = {"version": QUANTIZED_VERSION, "modules": quantized}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_safetensors(
        out_dir / "model.safetensors", entries, progress=progress, desc=f"Converting {gguf_path.name}"
    )
    _write_json(out_dir / "config.json", config)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    _write_json(out_dir / "generation_config.json", generation)
    _write_tokenizer(gguf_path, out_dir, meta.get("tokenizer.chat_template"))
    return out_dir
