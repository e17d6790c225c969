"""GGUF -> Hugging Face folder conversion (tandem.models.gguf_convert) checked against transformers.

Tiny random models are written to GGUF the way llama.cpp's convert_hf_to_gguf.py does (metadata keys,
gguf-py's tensor name map, the Q/K row permutation, 1-D tensors kept in F32, byte-level BPE vocab), converted
back, and compared with the original: weights, logits, tokenizer, config.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors import safe_open
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_SPLIT

from tandem.models.gguf_convert import UnsupportedGGUFError, build_hf_config, convert_gguf

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "Hello world, what is the capital of Germany? Berlin! Numbers: 12345, 2024.",
]
TOKENS = torch.tensor([[1, 5, 17, 42, 99, 200, 3, 7, 64, 128, 250, 311]])
CLASSES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    """A byte-level BPE tokenizer with 320 tokens, trained in a few milliseconds."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


def reference_tokenizer(bpe: Tokenizer, arch: str) -> Tokenizer:
    """The HF tokenizer the GGUF vocab came from; Qwen models split text with Qwen2's regex (pre "qwen2")."""
    if arch == "llama":
        return bpe
    tok = Tokenizer.from_str(bpe.to_str())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return tok


def tiny_model(arch: str, **overrides) -> torch.nn.Module:
    """A random model whose norms and biases are not at their init values, so swapping them would show."""
    torch.manual_seed(0)
    kwargs = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=arch == "llama",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    if arch == "qwen3":
        kwargs["head_dim"] = 32  # NOTE: differs from hidden/heads = 16, as in real Qwen3 models
    config_cls, model_cls = CLASSES[arch]
    model = model_cls(config_cls(**(kwargs | overrides))).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.2)
    return model


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute` (HF rotate-half rows -> interleaved)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def encode(array: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q | None]:
    if qtype == Q.F32:
        return array.astype(np.float32), None
    if qtype == Q.F16:
        return array.astype(np.float16), None
    if qtype == Q.BF16:
        return torch.from_numpy(array).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8), Q.BF16
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


def write_tokenizer_metadata(writer: gguf.GGUFWriter, bpe: Tokenizer, pre: str) -> None:
    """Tokenizer keys as llama.cpp's `_set_vocab_gpt2` writes them, plus the chat template."""
    vocab = bpe.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])  # 3 = CONTROL, 1 = NORMAL
    writer.add_token_merges([" ".join(m) for m in json.loads(bpe.to_str())["model"]["merges"]])
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)


def write_shape_metadata(writer: gguf.GGUFWriter, cfg) -> None:
    """The name and the model-shape keys every llama.cpp converter writes (from an HF config)."""
    writer.add_name("tiny")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)


def write_gguf(
    path,
    model,
    bpe: Tokenizer,
    arch: str,
    matrix_type: Q = Q.F32,
    raw: dict | None = None,
    rope_freqs: np.ndarray | None = None,
) -> None:
    """Write `model` like llama.cpp: 1-D tensors as F32, 2-D as `matrix_type` (or raw blocks from `raw`)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    write_shape_metadata(writer, cfg)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if arch == "llama":
        writer.add_rope_dimension_count(cfg.head_dim)
    if arch == "qwen3":
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    write_tokenizer_metadata(writer, bpe, "default" if arch == "llama" else "qwen2")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        data = tensor.float().numpy()
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            data = llama_cpp_permute(
                data, cfg.num_attention_heads if "q_proj" in base else cfg.num_key_value_heads
            )
        array, raw_dtype = (raw or {}).get(hf_name) or encode(data, matrix_type if data.ndim == 2 else Q.F32)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", array, raw_dtype=raw_dtype)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def round_trip(tmp_path, model, bpe, arch, keep_quantized=True, **kwargs):
    """Write a GGUF, convert it, load the folder with transformers in float32; return (folder, model)."""
    write_gguf(tmp_path / "tiny.gguf", model, bpe, arch, **kwargs)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf", progress=False, keep_quantized=keep_quantized)
    return out, AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_round_trip_reproduces_weights_logits_and_tokenizer(tmp_path, bpe, arch):
    model = tiny_model(arch)
    out, loaded = round_trip(tmp_path, model, bpe, arch)
    loaded_sd = loaded.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded_sd[name], tensor), name  # exact: Q/K un-permuted, biases and q/k norms kept
    assert rel_err(logits(loaded), logits(model)) < 1e-4

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__]
    assert config["tie_word_embeddings"] is (arch == "llama")
    cfg = model.config
    assert config["head_dim"] == getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert (config["rms_norm_eps"], config["torch_dtype"], config["vocab_size"]) == (1e-5, "float32", 320)
    with safe_open(out / "model.safetensors", "pt") as f:
        assert ("lm_head.weight" in f.keys()) is (arch != "llama")

    vocab = bpe.get_vocab()
    assert json.loads((out / "generation_config.json").read_text()) == {
        "bos_token_id": vocab["<|im_start|>"],
        "eos_token_id": vocab["<|im_end|>"],
    }
    tok, reference = AutoTokenizer.from_pretrained(out), reference_tokenizer(bpe, arch)
    for text in [*CORPUS, "Unseen wörds, 3.14!"]:
        assert tok.encode(text, add_special_tokens=False) == reference.encode(text).ids
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode("<|im_start|>user", add_special_tokens=False)[0] == vocab["<|im_start|>"]
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHATML


@pytest.mark.parametrize(
    ("qtype", "dtype", "tol"), [(Q.F16, torch.float16, 5e-3), (Q.BF16, torch.bfloat16, 3e-2)]
)
def test_half_precision_tensors_are_kept_as_is(tmp_path, bpe, qtype, dtype, tol):
    model = tiny_model("llama")
    # NOTE: keep_quantized=False (every block dequantized) is the folder transformers can read;
    # test_gguf_quantized.py checks the kept codes against the same blocks.
    out, loaded = round_trip(tmp_path, model, bpe, "llama", keep_quantized=False, matrix_type=qtype)
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == dtype
        assert f.get_tensor("model.layers.0.input_layernorm.weight").dtype == torch.float32
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == str(dtype).removeprefix("torch.")
    loaded_sd = loaded.state_dict()
    for name, tensor in model.state_dict().items():
        expected = tensor.to(dtype).float() if tensor.ndim == 2 else tensor
        assert torch.equal(loaded_sd[name], expected), name
    assert rel_err(logits(loaded), logits(model)) < tol


def block_error_bound(weight: np.ndarray, qtype: Q) -> np.ndarray:
    """Largest rounding error per 32-value block, from each format's scale (ggml-quants.c quantizers)."""
    blocks = weight.reshape(weight.shape[0], -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    if qtype == Q.Q8_0:
        bound = amax / 127 / 2  # d = amax / 127, round to nearest
    elif qtype == Q.Q4_0:
        bound = amax / 8  # d = max / -8; the value opposite the max clips from 16 to 15: one full step
    else:
        bound = (
            (blocks.max(-1, keepdims=True) - blocks.min(-1, keepdims=True)) / 15 / 2
        )  # Q4_1: d = range / 15
    # NOTE: d (and Q4_1's min) are stored as f16: a relative error up to 2**-11 on values up to amax.
    return np.broadcast_to(bound + amax / 1024 + 1e-7, blocks.shape).reshape(weight.shape)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_block_quantized_tensors_dequantize_within_format_error(tmp_path, bpe, qtype):
    model = tiny_model("llama")
    # NOTE: keep_quantized=False (every block dequantized) is the folder transformers can read;
    # test_gguf_quantized.py checks the kept codes against the same blocks.
    out, loaded = round_trip(tmp_path, model, bpe, "llama", keep_quantized=False, matrix_type=qtype)
    loaded_sd = loaded.state_dict()
    for name, tensor in model.state_dict().items():
        original = tensor.numpy()
        if tensor.ndim == 1:
            np.testing.assert_array_equal(loaded_sd[name].numpy(), original, err_msg=name)
            continue
        # NOTE: blocks run along rows, so llama.cpp's row permutation commutes with quantization.
        reference = gguf.quants.dequantize(gguf.quants.quantize(original, qtype), qtype)
        np.testing.assert_array_equal(loaded_sd[name].numpy(), reference, err_msg=name)
        assert (np.abs(reference - original) <= block_error_bound(original, qtype)).all(), name
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"


def encode_q4_k(rng: np.random.Generator, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Random Q4_K blocks (144 bytes per 256 values) and their values (``pack_q4_k``)."""
    n = rows * cols // 256
    d, dmin = rng.uniform(1e-3, 1e-2, (2, n)).astype(np.float16)
    sc, mn = rng.integers(0, 64, (2, n, 8))
    q = rng.integers(0, 16, (n, 8, 32))
    values = (
        d.astype(np.float32)[:, None, None] * sc[..., None] * q
        - dmin.astype(np.float32)[:, None, None] * mn[..., None]
    )
    return pack_q4_k(d, dmin, sc, mn, q).reshape(rows, -1), values.reshape(rows, cols).astype(np.float32)


def pack_q4_k(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, mn: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q4_K blocks ``[n, 144]`` from fp16 ``d, dmin [n]``, 6-bit ``sc, mn [n, 8]`` and 4-bit ``q [n, 8, 32]``,
    ggml's `block_q4_K` layout: f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks, 128
    bytes of 4-bit quants; value = d * scale_j * q - dmin * min_j (ggml-quants.c `dequantize_row_q4_K`,
    `get_scale_min_k4`)."""
    n = d.shape[0]
    scales = np.concatenate(
        [
            sc[:, :4] | (sc[:, 4:] >> 4) << 6,
            mn[:, :4] | (mn[:, 4:] >> 4) << 6,
            (sc[:, 4:] & 0xF) | (mn[:, 4:] & 0xF) << 4,
        ],
        axis=1,
    )
    qs = (q[:, 0::2] | q[:, 1::2] << 4).reshape(n, 128)  # sub-block 2i in low nibbles, 2i+1 in high
    blocks = np.concatenate(
        [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), scales, qs], axis=1
    )
    return blocks.astype(np.uint8)


def encode_q6_k(rng: np.random.Generator, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Random Q6_K blocks (210 bytes per 256 values) and their values (``pack_q6_k``)."""
    n = rows * cols // 256
    d = rng.uniform(1e-4, 1e-3, n).astype(np.float16)
    sc = rng.integers(-128, 128, (n, 16))
    q = rng.integers(0, 64, (n, 256))
    values = d.astype(np.float32)[:, None] * np.repeat(sc, 16, axis=1) * (q - 32)
    return pack_q6_k(d, sc, q).reshape(rows, -1), values.reshape(rows, cols).astype(np.float32)


def pack_q6_k(d: np.ndarray, sc: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q6_K blocks ``[n, 210]`` from fp16 ``d [n]``, int8 ``sc [n, 16]`` and 6-bit ``q [n, 256]``, ggml's
    `block_q6_K` layout: 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, f16 d;
    value i = d * scale[i // 16] * (q_i - 32) (ggml-quants.c `dequantize_row_q6_K`)."""
    n = d.shape[0]
    h = q.reshape(n, 2, 4, 32)  # value 128 * half + 32 * k + l
    ql = np.concatenate(
        [(h[:, :, 0] & 0xF) | (h[:, :, 2] & 0xF) << 4, (h[:, :, 1] & 0xF) | (h[:, :, 3] & 0xF) << 4], axis=2
    )
    qh = (h[:, :, 0] >> 4) | (h[:, :, 1] >> 4) << 2 | (h[:, :, 2] >> 4) << 4 | (h[:, :, 3] >> 4) << 6
    blocks = np.concatenate(
        [
            ql.reshape(n, 128),
            qh.reshape(n, 64),
            sc.astype(np.int8).view(np.uint8),
            d.view(np.uint8).reshape(n, 2),
        ],
        axis=1,
    )
    return blocks.astype(np.uint8)


def test_k_quant_tensors_dequantize_to_ggml_reference_values(tmp_path, bpe):
    model = tiny_model("llama", hidden_size=256, intermediate_size=256, num_hidden_layers=1)
    rng = np.random.default_rng(0)
    up, up_values = encode_q4_k(rng, 256, 256)
    down, down_values = encode_q6_k(rng, 256, 256)
    mlp = model.model.layers[0].mlp
    with torch.no_grad():
        mlp.up_proj.weight.copy_(torch.from_numpy(up_values))
        mlp.down_proj.weight.copy_(torch.from_numpy(down_values))
    raw = {
        "model.layers.0.mlp.up_proj.weight": (up, Q.Q4_K),
        "model.layers.0.mlp.down_proj.weight": (down, Q.Q6_K),
    }
    _, loaded = round_trip(tmp_path, model, bpe, "llama", keep_quantized=False, raw=raw)
    np.testing.assert_allclose(
        loaded.model.layers[0].mlp.up_proj.weight.detach().numpy(), up_values, rtol=1e-6, atol=1e-7
    )
    np.testing.assert_allclose(
        loaded.model.layers[0].mlp.down_proj.weight.detach().numpy(), down_values, rtol=1e-6, atol=1e-7
    )
    assert rel_err(logits(loaded), logits(model)) < 1e-4


def test_llama3_rope_freqs_tensor_becomes_llama3_rope_parameters(tmp_path, bpe):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    model = tiny_model("llama", rope_parameters=rope, max_position_embeddings=16384)
    # llama.cpp stores each frequency's divisor; derive it from transformers' own llama3 formula.
    default = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)  # head_dim 16
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](model.config)
    rope_freqs = (default / scaled).numpy()
    out, loaded = round_trip(tmp_path, model, bpe, "llama", rope_freqs=rope_freqs)
    assert json.loads((out / "config.json").read_text())["rope_parameters"] == rope
    assert rel_err(logits(loaded), logits(model)) < 1e-4

    meta = {
        "general.architecture": "llama",
        "llama.embedding_length": 64,
        "llama.attention.head_count": 4,
        "llama.feed_forward_length": 128,
        "llama.block_count": 2,
        "llama.context_length": 128,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
    }
    with pytest.raises(UnsupportedGGUFError, match="rope_freqs"):
        build_hf_config(meta, {"token_embd.weight": (320, 64)}, rope_freqs=rope_freqs[::-1].copy())


def write_gpt2_gguf(path) -> None:
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    write_gpt2_gguf(tmp_path / "gpt2.gguf")
    with pytest.raises(
        UnsupportedGGUFError, match=r"'gpt2' is not supported; supported: llama, qwen2, qwen3"
    ):
        convert_gguf(tmp_path / "gpt2.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
