"""Weight-only quantization of a loaded model's linear layers: ``int8`` and ``int4``.

Activations stay in the model dtype; only the weights of the linear layers are stored quantized
(decode reads every weight once per token, so fewer bytes per weight is proportionally faster):
  int8  symmetric per output channel: ``q = round(w / s)``, ``s = max|w_row| / 127``, q in [-127, 127].
  int4  symmetric per group of 32 weights of a row, llama.cpp Q4_0's scheme and layout: ``d = m / -8``
        where m is the group's value of largest magnitude, ``q = clamp(round(w / d), -8, 7)``, d stored
        as fp16; byte j of a group holds ``(q_j + 8) | (q_{j+16} + 8) << 4``. Layers whose input size
        is not a multiple of 32, and the LM head (whose errors go straight into the logits, which is
        why llama.cpp keeps its output tensor at higher precision too), use int8.
Two more formats hold a GGUF file's blocks as they are (``tandem/models/gguf_convert.py``, llama.cpp's
ggml-quants.c ``dequantize_row_q8_0`` / ``_q4_1``; GGUF Q4_0 is exactly ``int4``):
  q8_0  group-32 symmetric int8: ``qweight [N, K]`` int8, ``scale [N, K/32]`` fp16, ``w = q * d``.
  q4_1  group-32 asymmetric int4: ``qweight [N, K/2]`` uint8 in int4's nibble layout (u in 0..15),
        ``scale [N, K/32, 2]`` fp16 pairs ``(d, m)`` (the first 4 bytes of each block, interleaved so a
        row's scales and mins are one stream), ``w = u * d + m``.
Three more keep a GGUF's Q5_0 / Q4_K / Q6_K blocks (``q5_0``, ``q4_k``, ``q6_k``: ``qweight`` the blocks' bytes
without their fp16 fields, ``scale`` those fields; layouts and dequantization in ``tandem/models/gguf_blocks.py``).
``QuantizedLinear.empty`` makes a GGUF format's ``qweight`` and ``scale`` strided views of one buffer
(per row: its scales, then its codes, each starting 64-byte aligned), so a layer is one sequential stream.
The C++ kernels (``tandem.kernels.linear_int8/int4/q8_0/q4_1``) multiply bf16 activations with these
formats up to the token count the kernel registry allows (``tandem/kernels/registry.py``; avx2: every
batch, activations quantized per block of 32 as llama.cpp does); above it
(prefill on ``avx512_bf16``) the kernel dequantizes the weight for one oneDNN GEMM per call. On the
torch backend (no kernel for the format) the layer dequantizes its weight once, on first use, and keeps
the dense copy (fp32 on CPUs without bf16 dot products, where fp32 GEMMs are faster): dequantizing on
every call cost 80% of a decode step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tandem import kernels
from tandem.kernels import registry
from tandem.models import gguf_blocks
from tandem.models.layers import Linear

METHODS = ("int8", "int4")  # what quantize_model makes from float weights
FORMATS = ("int8", "int4", "q8_0", "q4_1", *gguf_blocks.KQUANT_FORMATS)  # every storage format of QuantizedLinear
ONE_BUFFER = ("q8_0", "q4_1", *gguf_blocks.KQUANT_FORMATS)  # formats whose scales and codes share one buffer
GROUP = 32


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> (``q [N, K]`` int8, ``scale [N]`` fp32), per-row symmetric."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 ``[N, K]`` weights of an int8 layer."""
    return q.float() * scale[:, None]


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` (K % 32 == 0) -> (``packed [N, K/2]`` uint8, ``scale [N, K/32]`` fp16).

    Raises:
        ValueError: K is not a multiple of 32.
    """
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"int4 needs an input size that is a multiple of {GROUP}, got {k}")
    w = weight.float().view(n, k // GROUP, GROUP)
    idx = w.abs().argmax(dim=2, keepdim=True)
    d = (torch.gather(w, 2, idx) / -8.0).squeeze(2).half()  # NOTE: round d first, then q against it
    d_f = d.float()
    inv = torch.where(d_f != 0, 1.0 / d_f, torch.zeros_like(d_f))
    q = torch.round(w * inv[..., None]).clamp_(-8, 7).to(torch.int16) + 8  # [n, groups, 32] in 0..15
    packed = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8)
    return packed.view(n, k // 2), d


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 ``[N, K]`` weights of an int4 layer (inverse of ``quantize_int4`` up to rounding)."""
    q = _unpack_nibbles(packed) - 8.0
    return (q * scale.float()[..., None]).view(packed.shape[0], -1)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``packed [N, K/2]`` uint8 in int4's layout -> the codes ``[N, K/32, 32]`` float32 in 0..15."""
    b = packed.view(packed.shape[0], -1, GROUP // 2).to(torch.int16)
    return torch.cat([b & 0xF, b >> 4], dim=2).float()


def dequantize_q8_0(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 ``[N, K]`` weights of a q8_0 layer: ``q [N, K]`` int8 times its group's ``scale [N, K/32]``."""
    n = q.shape[0]
    return (q.view(n, -1, GROUP).float() * scale.float()[..., None]).view(n, -1)


def dequantize_q4_1(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 ``[N, K]`` weights of a q4_1 layer: ``u * d + m`` per group of 32, ``scale [N, K/32, 2]`` = (d, m)."""
    u = _unpack_nibbles(packed)
    s = scale.float()
    return (u * s[..., 0:1] + s[..., 1:2]).view(packed.shape[0], -1)


def dequantize_weight(method: str, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 ``[N, K]`` weights of a layer stored in ``method`` (one of ``FORMATS``).

    Raises:
        ValueError: an unknown ``method``.
    """
    if method == "int8":
        return dequantize_int8(qweight, scale)
    if method == "int4":
        return dequantize_int4(qweight, scale)
    if method == "q8_0":
        return dequantize_q8_0(qweight, scale)
    if method == "q4_1":
        return dequantize_q4_1(qweight, scale)
    if method in gguf_blocks.KQUANT_FORMATS:
        return gguf_blocks.dequantize(method, qweight, scale)
    raise ValueError(f"quantized format must be one of {FORMATS}, got {method!r}")


def quantized_shapes(
    method: str, out_features: int, in_features: int
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{buffer name: (shape, dtype)}`` of a ``method`` layer with weight ``[out_features, in_features]``.

    Raises:
        ValueError: an unknown ``method``, or a group format with ``in_features % 32 != 0``.
    """
    if method not in FORMATS:
        raise ValueError(f"quantized format must be one of {FORMATS}, got {method!r}")
    n, k = out_features, in_features
    if method == "int8":
        return {"qweight": ((n, k), torch.int8), "scale": ((n,), torch.float32)}
    if method in gguf_blocks.KQUANT_FORMATS:
        return gguf_blocks.block_shapes(method, n, k)
    if k % GROUP:
        raise ValueError(f"{method} needs an input size that is a multiple of {GROUP}, got {k}")
    groups = ((n, k // GROUP), torch.float16)
    if method == "q8_0":
        return {"qweight": ((n, k), torch.int8), "scale": groups}
    if method == "q4_1":
        return {"qweight": ((n, k // 2), torch.uint8), "scale": ((n, k // GROUP, 2), torch.float16)}
    return {"qweight": ((n, k // 2), torch.uint8), "scale": groups}


class QuantizedLinear(nn.Module):
    """A ``Linear`` with quantized weights (buffers ``qweight`` and ``scale``, see ``FORMATS``); bias as is.

    ``QuantizedLinear(linear, "int8" | "int4")`` quantizes a float layer; ``QuantizedLinear.empty`` makes
    one of any of ``FORMATS`` for the loader to fill with a checkpoint's codes (GGUF blocks).
    ``forward(x [T, K]) -> [T, N]`` in ``x``'s dtype.

    ``dense`` is the torch backend's dequantized weight ``[N, K]`` (None until a forward pass needs it;
    not a buffer, so ``state_dict`` holds only the codes). Writing new codes into the buffers after
    that needs ``drop_dense()``.
    """

    dense: torch.Tensor | None = None

    def __init__(self, linear: Linear, method: str) -> None:
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"quantization must be one of {METHODS}, got {method!r}")
        weight = linear.dense_weight().detach()
        self.output_sizes, self.shard_names = linear.output_sizes, linear.shard_names
        self.in_features = weight.shape[1]
        self.method = "int4" if method == "int4" and self.in_features % GROUP == 0 else "int8"
        quantize = quantize_int4 if self.method == "int4" else quantize_int8
        qweight, scale = quantize(weight)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.bias = linear.bias

    @classmethod
    def empty(
        cls,
        method: str,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        shard_names: tuple[str, ...] = (),
    ) -> QuantizedLinear:
        """An uninitialized ``method`` layer shaped like ``Linear(input_size, output_sizes, ...)``.

        The loader copies each shard's codes into its rows (``torch.empty``: nothing is initialized).

        Raises:
            ValueError: see ``quantized_shapes``.
        """
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.output_sizes, self.shard_names = list(output_sizes), tuple(shard_names)
        self.in_features, self.method = input_size, method
        shapes = quantized_shapes(method, sum(output_sizes), input_size)
        if method in ONE_BUFFER:
            # NOTE: one buffer, each row's fp16 scales just before its codes (both starting 64-byte aligned):
            # the kernels read the weights as one sequential stream (about 34 bytes per 32 weights, as
            # llama.cpp's blocks); ``qweight`` and ``scale`` are strided views of it. Separate arrays are
            # two streams, measured 15-20% slower on layers read from DRAM.
            (n, k), code_dtype = shapes["qweight"]  # k: code bytes per row
            scale_shape = shapes["scale"][0]  # [n, groups] or [n, groups, 2], fp16
            scale_bytes = 2 * math.prod(scale_shape[1:])
            head = -(-scale_bytes // 64) * 64
            packed = torch.empty(n, -(-(head + k) // 64) * 64, dtype=code_dtype)
            self.register_buffer("scale", packed[:, :scale_bytes].view(torch.float16).unflatten(1, scale_shape[1:]))
            self.register_buffer("qweight", packed[:, head : head + k])
            shapes = {}
        for name, (shape, buf_dtype) in shapes.items():
            self.register_buffer(name, torch.empty(shape, dtype=buf_dtype))
        out = sum(output_sizes)
        self.bias = nn.Parameter(torch.empty(out, dtype=dtype), requires_grad=False) if bias else None
        return self

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``[N, K]`` as ``dtype`` (the PyTorch path and the kernels' oracle)."""
        return dequantize_weight(self.method, self.qweight, self.scale).to(dtype)

    _LINEAR_OPS = {"int4": "linear_int4", "int8": "linear_int8", "q8_0": "linear_q8_0", "q4_1": "linear_q4_1",
                   **{f: f"linear_{f}" for f in gguf_blocks.KQUANT_FORMATS}}
    _DEQUANT_OPS = {"int4": "dequantize", "int8": "dequantize", "q8_0": "dequantize_q8_0", "q4_1": "dequantize_q4_1"}

    def _kernel_dequantized(self) -> torch.Tensor:
        return getattr(kernels, self._DEQUANT_OPS[self.method])(self.qweight, self.scale)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The torch backend's weight ``[N, K]`` in ``dtype``, dequantized on the first call and kept.

        Changes: sets ``dense`` (replaced when another dtype is asked for).
        """
        if self.dense is None or self.dense.dtype != dtype:
            self.dense = self.dequantized(dtype)
        return self.dense

    def drop_dense(self) -> None:
        """Forgets the dense copy (after new codes were written). Changes: ``dense``."""
        self.dense = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = self._LINEAR_OPS[self.method]
        bf16 = x.dtype == torch.bfloat16
        if (bf16 and x.dim() == 2 and (self.bias is None or self.bias.dtype == torch.bfloat16)
                and registry.use(op, tokens=x.shape[0])):
            return getattr(kernels, op)(x, self.qweight, self.scale, self.bias)
        dequant_op = self._DEQUANT_OPS.get(self.method)
        if bf16 and dequant_op is not None and registry.use(op) and registry.use(dequant_op):
            # NOTE: more tokens than the kernel takes (prefill on avx512_bf16) is compute-bound: one fast
            # dequantization per call, then oneDNN's bf16 GEMM; no dense copy is kept.
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self._kernel_dequantized(), bias)
        compute = registry.torch_compute_dtype(x.dtype)
        bias = None if self.bias is None else self.bias.to(compute)
        return F.linear(x.to(compute), self.dense_weight(compute), bias).to(x.dtype)

    def kernel_linear(self, tokens: int) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """``(format, qweight, scale, bias)`` for ``kernels.decoder_layer`` when ``forward`` over ``tokens``
        tokens of bf16 activations would call this format's linear kernel in the fused layer's own build, else
        None (the GGUF K-quants on avx512_bf16, whose kernels the registry routes to the avx2 build)."""
        op = self._LINEAR_OPS[self.method]
        if (self.method in kernels.LINEAR_KINDS and (self.bias is None or self.bias.dtype == torch.bfloat16)
                and registry.use(op, tokens=tokens)
                and registry.backend_for(op) == registry.backend_for("decoder_layer")):
            return self.method, self.qweight, self.scale, self.bias
        return None

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.qweight.shape[0]}, method={self.method}"


class ConcatLinear(nn.Module):
    """A fused projection whose shards a GGUF file stores in different formats (a Q4_K_M file's q/k in Q5_0 and
    v in Q8_0): one ``QuantizedLinear`` per run of consecutive shards sharing a format, outputs concatenated.

    ``forward(x [T, K]) -> [T, sum(output_sizes)]`` in ``x``'s dtype; each part's rows as its own layer's, so
    batch invariant wherever the parts are. ``parts[i].shard_names`` name checkpoint modules beside this one.
    """

    def __init__(self, parts: list[QuantizedLinear]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.output_sizes = [size for part in parts for size in part.output_sizes]
        self.shard_names = tuple(name for part in parts for name in part.shard_names)

    @classmethod
    def empty(cls, formats: list[str], input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype,
              shard_names: tuple[str, ...]) -> ConcatLinear:
        """Uninitialized parts for shards ``shard_names`` (rows ``output_sizes``) stored in ``formats``.

        Raises:
            ValueError: see ``quantized_shapes``.
        """
        runs: list[list[int]] = []
        for i, fmt in enumerate(formats):
            if runs and formats[runs[-1][0]] == fmt:
                runs[-1].append(i)
            else:
                runs.append([i])
        return cls([QuantizedLinear.empty(formats[run[0]], input_size, [output_sizes[i] for i in run], bias, dtype,
                                          tuple(shard_names[i] for i in run)) for run in runs])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def kernel_linear(self, tokens: int) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]] | None:
        """The parts' ``QuantizedLinear.kernel_linear`` tuples for ``kernels.decoder_layer`` (which concatenates
        their outputs as ``forward`` does), or None when any part has no kernel for ``tokens`` tokens."""
        parts = [part.kernel_linear(tokens) for part in self.parts]
        return None if any(p is None for p in parts) else parts


def quantize_model(model: nn.Module, method: str) -> nn.Module:
    """Replace every ``Linear`` of ``model`` with a ``QuantizedLinear`` (int4 uses int8 for the LM head), and
    every MoE block's ``FusedExperts`` with a ``models.moe_quant.QuantizedExperts``.

    Changes: ``model``'s modules in place; the float weights of replaced layers are freed, except a
    tied LM head's, which is the embedding table and stays (lookups read one row of it per token).
    Layers that are already ``QuantizedLinear`` (a GGUF's Q8_0/Q4_0/Q4_1 weights, loaded as they are in
    the file) are kept: re-quantizing their codes would only add error. Returns ``model``.

    Raises:
        ValueError: an unknown ``method``.
    """
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {METHODS}, got {method!r}")
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, Linear)]
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer_method = "int8" if name.endswith("lm_head") else method
        with torch.no_grad():
            setattr(parent, attr, QuantizedLinear(module, layer_method))
    # NOTE: imported here: models.moe_quant builds on this module's quantizers.
    from tandem.models.moe_quant import quantize_experts

    quantize_experts(model, method)
    return model

