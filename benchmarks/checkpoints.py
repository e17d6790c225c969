"""Random-weight checkpoints of real model shapes, for benchmarks (no downloads).

``make_checkpoint(shape, dir)`` saves a bf16 Hugging Face folder (config, safetensors, a word-level
tokenizer with one token per id) with transformers; ``write_gguf(dir, path, qtype)`` writes the same
weights as a llama.cpp GGUF (BF16, F16, Q8_0, Q4_0 or Q4_1) with the ``gguf`` package, following llama.cpp's
``convert_hf_to_gguf.py`` (tensor names, the Q/K row permutation for ``llama``, the llama3
``rope_freqs`` tensor, an SPM vocabulary).

Shapes are the published ``config.json`` values of Qwen/Qwen2.5-0.5B-Instruct,
meta-llama/Llama-3.2-1B-Instruct and Qwen/Qwen3-30B-A3B (its real widths and expert counts, with 2 of
its 48 layers, so it fits this machine: a mixture-of-experts shape; and with 6 layers, written straight to
GGUF by ``moe_gguf.py``). MoE experts are written to GGUF merged into llama.cpp's 3-D ``ffn_{gate,up,down}_exps``
tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(
        config_cls="Qwen2Config", gguf_arch="qwen2", hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=151643, eos_token_id=151645,
    ),
    "llama-3.2-1b": dict(
        config_cls="LlamaConfig", gguf_arch="llama", hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        bos_token_id=128000, eos_token_id=128009,
    ),
    "qwen3-30b-a3b-l2": dict(
        config_cls="Qwen3MoeConfig", gguf_arch="qwen3moe", hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=151643, eos_token_id=151645,
    ),
}
# 6 of the 48 layers: experts are 85% of the file and a third of a token's weight bytes (the rest: the LM head,
# attention), and the Q4_0 file (2.4 GB, moe_gguf.write_random_moe_gguf) fits this 24 GiB shared machine.
SHAPES["qwen3-30b-a3b-l6"] = {**SHAPES["qwen3-30b-a3b-l2"], "num_hidden_layers": 6}
_NON_CONFIG = ("config_cls", "gguf_arch")


def hf_config(shape: str):  # noqa: ANN201 (a transformers PretrainedConfig)
    """The transformers config of ``shape`` (one of ``SHAPES``)."""
    import transformers

    spec = SHAPES[shape]
    kwargs = {k: v for k, v in spec.items() if k not in _NON_CONFIG}
    return getattr(transformers, spec["config_cls"])(**kwargs)


def make_checkpoint(shape: str, out_dir: Path, seed: int = 0) -> Path:
    """Save a random bf16 checkpoint of ``shape`` and a word-level tokenizer into ``out_dir``.

    Weights follow transformers' init (normal, std 0.02); norms are 1. Reuses ``out_dir`` when a
    previous call completed there (``.complete`` marker). Returns ``out_dir``.
    """
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    if (out_dir / ".complete").is_file():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(shape), dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    write_tokenizer(out_dir, SHAPES[shape]["vocab_size"], SHAPES[shape]["bos_token_id"],
                    SHAPES[shape]["eos_token_id"])
    del model
    (out_dir / ".complete").write_text("ok\n")
    return out_dir


def write_tokenizer(out_dir: Path, vocab_size: int, bos_id: int, eos_id: int) -> None:
    """A word-level tokenizer: token ``t{i}`` is id ``i``; ids ``bos_id``/``eos_id`` are special."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token=f"t{bos_id}",
                                   eos_token=f"t{eos_id}")
    fast.save_pretrained(str(out_dir))


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py ``LlamaModel.permute``: HF rotate-half rows -> llama.cpp interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_freqs(cfg) -> np.ndarray | None:  # noqa: ANN001
    """llama3 frequency divisors (``rope_freqs.weight``), as convert_hf_to_gguf.py writes them."""
    from tandem.models.hf_config import RopeConfig
    from tandem.models.layers import rope_inv_freq

    rope = cfg.rope_parameters
    if rope.get("rope_type") != "llama3":
        return None
    head_dim = cfg.head_dim
    llama3 = RopeConfig(theta=rope["rope_theta"], rope_type="llama3", factor=rope["factor"],
                        low_freq_factor=rope["low_freq_factor"], high_freq_factor=rope["high_freq_factor"],
                        original_max_position_embeddings=rope["original_max_position_embeddings"])
    default = RopeConfig(theta=rope["rope_theta"])
    return (rope_inv_freq(head_dim, default) / rope_inv_freq(head_dim, llama3)).numpy().astype(np.float32)


def _write_vocab(writer, vocab_size: int, bos_id: int, eos_id: int) -> None:  # noqa: ANN001
    """An SPM vocabulary of ``vocab_size`` tokens (llama.cpp needs one to load a model)."""
    tokens = [f"\u2581t{i}" for i in range(vocab_size)]
    types = [1] * vocab_size  # 1 = NORMAL
    tokens[0], types[0] = "<unk>", 2  # 2 = UNKNOWN
    for i in (bos_id, eos_id):
        types[i] = 3  # 3 = CONTROL
    for b in range(256):  # byte fallback tokens <0x00>.. right after <unk>
        tokens[1 + b], types[1 + b] = f"<0x{b:02X}>", 6  # 6 = BYTE
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * vocab_size)
    writer.add_token_types(types)
    writer.add_bos_token_id(bos_id)
    writer.add_eos_token_id(eos_id)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)


# GGUF types write_gguf makes for 2-D weights -> (GGML type name, llama.cpp file type name).
GGUF_TYPES = {
    "bf16": ("BF16", "MOSTLY_BF16"),
    "f16": ("F16", "MOSTLY_F16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
    "q4_1": ("Q4_1", "MOSTLY_Q4_1"),
}


def write_gguf(hf_dir: Path, path: Path, qtype: str = "bf16") -> Path:
    """Write the checkpoint in ``hf_dir`` as a GGUF file with 2-D weights in ``qtype`` (``GGUF_TYPES``).

    1-D tensors (norms, biases) stay F32, as llama.cpp's converter writes them. Reuses ``path``
    when it exists. Returns ``path``.

    Raises:
        ValueError: an unknown ``qtype``.
    """
    import gguf
    from gguf import GGMLQuantizationType as Q
    from safetensors.torch import load_file
    from transformers import AutoConfig

    if qtype not in GGUF_TYPES:
        raise ValueError(f"qtype must be one of {sorted(GGUF_TYPES)}, got {qtype!r}")
    ggml_type, file_type = GGUF_TYPES[qtype]
    path = Path(path)
    if path.is_file():
        return path
    cfg = AutoConfig.from_pretrained(hf_dir)
    arch = GGUF_ARCH[cfg.model_type]
    partial = path.with_name(path.name + ".partial")  # NOTE: renamed when complete: an interrupted write is redone
    writer = new_writer(cfg, partial, file_type)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    state = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        state.update(load_file(str(f)))
    state = _merge_experts(state, getattr(cfg, "num_experts", 0))
    for hf_name in list(state):
        tensor = state.pop(hf_name)  # NOTE: the writer keeps each array until it writes; drop the source
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = f"{names.get_name(base)}.{'weight' if suffix == 'merged' else suffix}"
        if qtype == "bf16" and tensor.dim() > 1 and not (arch == "llama" and base.endswith(("q_proj", "k_proj"))):
            array = tensor.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)  # no fp32 copy
            writer.add_tensor(gguf_name, array, raw_dtype=Q.BF16)
            continue
        data = tensor.float().numpy()
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            heads = cfg.num_attention_heads if base.endswith("q_proj") else cfg.num_key_value_heads
            data = _llama_cpp_permute(data, heads)
        if data.ndim == 1:
            array, raw = data.astype(np.float32), None
        elif qtype == "bf16":
            array = torch.from_numpy(data).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
            raw = Q.BF16
        elif qtype == "f16":
            array, raw = data.astype(np.float16), None
        else:
            raw = getattr(Q, ggml_type)
            array = gguf.quants.quantize(data, raw)
        writer.add_tensor(gguf_name, array, raw_dtype=raw)
    freqs = _rope_freqs(cfg)
    if freqs is not None:
        writer.add_tensor("rope_freqs.weight", freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(path)
    return path


GGUF_ARCH = {"qwen2": "qwen2", "llama": "llama", "qwen3_moe": "qwen3moe"}  # HF model_type -> GGUF architecture


def new_writer(cfg, path: Path, file_type: str):  # noqa: ANN001, ANN201 (a transformers config -> gguf.GGUFWriter)
    """A ``gguf.GGUFWriter`` on ``path`` with ``cfg``'s metadata (llama.cpp's keys) and vocabulary written."""
    import gguf

    arch = GGUF_ARCH[cfg.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"random-{cfg.model_type}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    if arch == "qwen3moe":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    writer.add_file_type(getattr(gguf.LlamaFileType, file_type))
    _write_vocab(writer, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    return writer


def _merge_experts(state: dict, num_experts: int) -> dict:
    """Per-expert ``mlp.experts.N.{gate,up,down}_proj.weight`` -> llama.cpp's merged ``[E, ...]`` tensors,
    named ``mlp.experts.{gate,up,down}_proj.merged`` (``get_tensor_name_map`` maps the stem to
    ``ffn_*_exps``)."""
    if not num_experts:
        return state
    out, groups = {}, {}
    for name, tensor in state.items():
        parts = name.split(".")
        if ".mlp.experts." in name and parts[-3].isdigit():
            groups.setdefault(".".join(parts[:-3] + [parts[-2]]), {})[int(parts[-3])] = tensor
        else:
            out[name] = tensor
    for stem, experts in groups.items():
        out[f"{stem}.merged"] = torch.stack([experts[e] for e in range(num_experts)])
    return out


def active_weight_bytes(hf_dir: Path) -> int:
    """Bytes one batch-1 decode step reads: every weight except an untied embedding table (a lookup reads
    one row), and only ``top_k / E`` of each layer's experts (the MoE roofline's numerator)."""
    cfg = describe(hf_dir)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    top_k = cfg.get("num_experts_per_tok") or 0
    table = 0 if cfg.get("tie_word_embeddings") else weight_bytes(hf_dir, only="embed_tokens")
    if not experts:
        return weight_bytes(hf_dir) - table
    dense = weight_bytes(hf_dir, skip=".mlp.experts.") - table
    return dense + weight_bytes(hf_dir, only=".mlp.experts.") * top_k // experts


def weight_bytes(hf_dir: Path, only: str | None = None, skip: str | None = None) -> int:
    """Bytes of all weights in the checkpoint (what one batch-1 decode step reads, tied lm_head once)."""
    from safetensors import safe_open

    total = 0
    for f in Path(hf_dir).glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                if (only and only not in name) or (skip and skip in name):
                    continue
                sl = h.get_slice(name)
                itemsize = {"BF16": 2, "F16": 2, "F32": 4, "I8": 1, "U8": 1}[sl.get_dtype()]
                total += int(np.prod(sl.get_shape())) * itemsize
    return total


def describe(hf_dir: Path) -> dict:
    """The checkpoint's config.json as a dict (for reports)."""
    return json.loads((Path(hf_dir) / "config.json").read_text())
