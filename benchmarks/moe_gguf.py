"""Random-weight mixture-of-experts GGUF files written directly, and the bytes a decode step reads from them.

``write_random_moe_gguf(shape, path, qtype)`` writes a ``checkpoints.SHAPES`` MoE shape (llama.cpp's
``qwen3moe`` tensors: merged ``ffn_{gate,up,down}_exps``, an F32 router ``ffn_gate_inp`` as llama.cpp's
quantizer leaves it, F32 norms) as a Q8_0 or Q4_0 file without a Hugging Face checkpoint: each tensor's
blocks are drawn at random (uniform codes, one fp16 scale per tensor giving the weights a standard
deviation of 0.02, as transformers' init) and written before the next is made, so memory holds one tensor
(at most the 0.33 GB Q8_0 LM head) however many layers the shape has. A checkpoint of Qwen3-30B-A3B's real
widths with 6 of its 48 layers is 4.6 GB in bf16, which two 3.7 GB copies of the 2-layer one already showed
this 24 GiB machine cannot hold beside its other work.

``step_bytes`` counts what a step's kernels read: every tensor but the embedding table (a lookup reads one
row), and of each layer's experts only those selected (the fused MoE kernel reads a selected expert once
per step, however many tokens chose it). At one token that is the active-parameter bytes, the MoE roofline.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from checkpoints import GGUF_TYPES, SHAPES, hf_config, new_writer

QTYPES = ("q8_0", "q4_0")
# GGML block type -> (values per block, bytes per block, standard deviation of a uniform code in units of d):
# Q8_0 codes int8 in [-127, 127] (0 twice as likely: std 73.5), Q4_0 nibbles n, value n - 8 in [-7, 7] (0 twice
# as likely: std 4.18).
_BLOCKS = {"Q8_0": (32, 34, 73.5), "Q4_0": (32, 18, 4.18)}
_STD = 0.02


def _quantized(rng: np.random.Generator, shape: tuple[int, ...], ggml_type: str) -> np.ndarray:
    """Random blocks of ``ggml_type`` for a weight of HF shape ``shape``, as GGUF's uint8 byte array."""
    values, nbytes, code_std = _BLOCKS[ggml_type]
    *lead, k = shape
    blocks = rng.integers(0, 256, (*lead, k // values, nbytes), dtype=np.uint8)
    # NOTE: codes symmetric around 0 (mean 0): a mean of half a step in every matrix adds up along the all-ones
    # direction layer after layer until every token's hidden state, and so its experts, are the same.
    if ggml_type == "Q8_0":
        blocks[blocks == 0x80] = 0  # -128 (never written by llama.cpp's quantizer) -> 0: codes in [-127, 127]
    else:
        low, high = blocks & 0x0F, blocks >> 4  # value n - 8: nibble 0 (-8) -> 8 (0), values in [-7, 7]
        blocks[:] = np.where(low == 0, 8, low) | (np.where(high == 0, 8, high) << 4)
    blocks[..., :2] = np.frombuffer(np.float16(_STD / code_std).tobytes(), dtype=np.uint8)
    return blocks.reshape(*lead, k // values * nbytes)


def _tensors(cfg) -> list[tuple[str, tuple[int, ...], bool]]:  # noqa: ANN001 (a transformers config)
    """(GGUF name, HF shape, quantized) of every tensor of a qwen3moe file, in file order."""
    h, hd, e, i = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.moe_intermediate_size
    out = [("token_embd.weight", (cfg.vocab_size, h), True), ("output_norm.weight", (h,), False),
           ("output.weight", (cfg.vocab_size, h), True)]
    for n in range(cfg.num_hidden_layers):
        b = f"blk.{n}."
        out += [(b + "attn_norm.weight", (h,), False), (b + "attn_q.weight", (cfg.num_attention_heads * hd, h), True),
                (b + "attn_k.weight", (cfg.num_key_value_heads * hd, h), True),
                (b + "attn_v.weight", (cfg.num_key_value_heads * hd, h), True),
                (b + "attn_output.weight", (h, cfg.num_attention_heads * hd), True),
                (b + "attn_q_norm.weight", (hd,), False), (b + "attn_k_norm.weight", (hd,), False),
                (b + "ffn_norm.weight", (h,), False), (b + "ffn_gate_inp.weight", (e, h), False),
                (b + "ffn_gate_exps.weight", (e, i, h), True), (b + "ffn_up_exps.weight", (e, i, h), True),
                (b + "ffn_down_exps.weight", (e, h, i), True)]
    return out


def write_random_moe_gguf(shape: str, path: Path, qtype: str, seed: int = 0) -> Path:
    """Write the MoE ``shape`` (a ``checkpoints.SHAPES`` qwen3moe entry) as a random ``qtype`` GGUF at ``path``.

    Norms are 1, the router is F32 normal(0, 0.02), every other matrix random ``qtype`` blocks. Reuses
    ``path`` when it exists (a write in progress goes to ``<path>.partial``). Returns ``path``.

    Raises:
        ValueError: ``qtype`` is not one of ``QTYPES`` or ``shape`` is not a qwen3moe shape.
    """
    from gguf import GGMLQuantizationType as Q

    if qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {QTYPES}, got {qtype!r}")
    if SHAPES[shape].get("gguf_arch") != "qwen3moe":
        raise ValueError(f"{shape} is not a qwen3moe shape")
    path = Path(path)
    if path.is_file():
        return path
    cfg = hf_config(shape)
    ggml_type, file_type = GGUF_TYPES[qtype]
    partial = path.with_name(path.name + ".partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = new_writer(cfg, partial, file_type)
    tensors = _tensors(cfg)
    for name, hf_shape, quantized in tensors:
        if quantized:
            values, nbytes, _ = _BLOCKS[ggml_type]
            byte_shape = (*hf_shape[:-1], hf_shape[-1] // values * nbytes)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                                   getattr(Q, ggml_type))
        else:
            writer.add_tensor_info(name, hf_shape, np.dtype(np.float32), int(np.prod(hf_shape)) * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, hf_shape, quantized in tensors:
        if quantized:
            array = _quantized(rng, hf_shape, ggml_type)
        elif name.endswith("ffn_gate_inp.weight"):
            array = (rng.standard_normal(hf_shape, dtype=np.float32) * _STD).astype(np.float32)
        else:
            array = np.ones(hf_shape, dtype=np.float32)
        writer.write_tensor_data(array)
        del array
    writer.close()
    partial.rename(path)
    return path


@dataclass(frozen=True)
class StepBytes:
    """A MoE GGUF's weight bytes by kind: ``dense`` (read once per step: attention, norms, routers, LM head),
    ``expert`` (one expert's gate + up + down, per layer), ``experts`` and ``top_k`` per token."""

    dense: int
    expert: tuple[int, ...]
    experts: int
    top_k: int

    @property
    def active(self) -> int:
        """Bytes of one token's weights: dense + top_k experts per layer (the MoE roofline's numerator)."""
        return self.dense + self.top_k * sum(self.expert)

    def read(self, selected: list[int]) -> int:
        """Bytes a step reads when layer ``l`` selects ``selected[l]`` distinct experts."""
        return self.dense + sum(n * b for n, b in zip(selected, self.expert, strict=True))


def step_bytes(path: Path) -> StepBytes:
    """``StepBytes`` of a MoE GGUF file (from its tensor sizes and expert counts)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    experts = int(reader.fields[f"{arch}.expert_count"].parts[-1][0])
    top_k = int(reader.fields[f"{arch}.expert_used_count"].parts[-1][0])
    names = {t.name for t in reader.tensors}
    dense, expert = 0, {}
    for t in reader.tensors:
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue
        if "_exps." in t.name:
            layer = int(t.name.split(".")[1])
            expert[layer] = expert.get(layer, 0) + int(t.n_bytes) // experts
        else:
            dense += int(t.n_bytes)
    return StepBytes(dense, tuple(expert[n] for n in sorted(expert)), experts, top_k)


class ExpertReads:
    """Counts the distinct experts each MoE layer's kernel reads per decode step of a Tandem model.

    ``ExpertReads(model)`` wraps every MoE block's ``experts.forward`` (counting its ``ids [T, k]`` argument);
    ``take()`` returns and clears ``(tokens, [distinct experts per layer])`` of each step since the last call.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from tandem.models.moe import SparseMoeBlock

        self._layers = [m.experts for m in model.modules() if isinstance(m, SparseMoeBlock)]
        self._calls: list[tuple[int, int]] = []
        for module in self._layers:  # NOTE: the blocks call experts.forward directly, so no module hooks
            module.forward = self._counted(module.forward)

    def _counted(self, forward):  # noqa: ANN001, ANN202
        def counted(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            self._calls.append((ids.shape[0], int(ids.unique().numel())))
            return forward(x, weights, ids)
        return counted

    def take(self) -> list[tuple[int, list[int]]]:
        n = len(self._layers)
        calls, self._calls = self._calls, []
        return [(calls[i][0], [c[1] for c in calls[i:i + n]]) for i in range(0, len(calls), n)]


def read_summary(steps: list[tuple[int, list[int]]], sizes: StepBytes) -> str:
    """One line per step size (tokens) in ``steps`` (``ExpertReads.take()``): median weight GB read per token
    and per step, against the active-parameter bytes."""
    per_size: dict[int, list[float]] = {}
    for tokens, selected in steps:
        per_size.setdefault(tokens, []).append(sizes.read(selected) / tokens)
    lines = []
    for tokens in sorted(per_size):
        per_token = float(np.median(per_size[tokens]))
        lines.append(f"{tokens}-token steps ({len(per_size[tokens])}): {per_token / 1e9:.3f} GB of weights read per "
                     f"token, {per_token * tokens / 1e9:.3f} GB per step, {per_token / sizes.active:.2f}x the "
                     f"{sizes.active / 1e9:.3f} GB active per token")
    return "\n".join(lines)
