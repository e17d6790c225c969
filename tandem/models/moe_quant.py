"""Weight-only int8 / int4 experts: ``FusedExperts`` with each expert's matrices stored as codes + scales.

``--quantization int8`` / ``int4`` (``models.quant.quantize_model``) turns every ``FusedExperts`` into a
``QuantizedExperts``: each expert's ``w13 [2I, H]`` and ``w2 [H, I]`` quantized as a dense layer would be
(``quant.quantize_int8``: per output row; ``quant.quantize_int4``: llama.cpp Q4_0, groups of 32), and
stacked. int4 needs ``H`` and ``I`` to be multiples of 32; otherwise the experts use int8. bf16 models run
``kernels.moe_int8`` / ``moe_int4`` (tokens grouped by expert, each selected expert's codes read once per
step, one OpenMP team); elsewhere (float32 models, the torch backend) the experts are dequantized once,
kept, and run ``moe.moe_grouped``, as ``QuantizedLinear`` does. A GGUF's Q8_0 / Q4_0 experts
(``gguf_convert`` keeps their codes) load into ``QuantizedExperts.empty`` as stored: ``q8_0`` (group-32
int8, ``kernels.moe_q8_0``) or ``int4`` (which is Q4_0); Q4_K / Q6_K ones as ``q4_k`` / ``q6_k``
(``kernels.moe_kquant``), where w13 (gate and up) and w2 (down) may differ, as in llama.cpp's Q4_K_M files.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem import kernels
from tandem.kernels import registry
from tandem.models.moe import FusedExperts, SparseMoeBlock, moe_grouped
from tandem.models.quant import GROUP, METHODS, dequantize_weight, quantize_int4, quantize_int8, quantized_shapes

GGUF_FORMATS = ("q8_0", "int4")  # a GGUF's Q8_0 / Q4_0 experts, kept as stored (gguf_convert.KEPT_EXPERT_BLOCKS)
KQUANT_FORMATS = ("q4_k", "q6_k")  # a GGUF's Q4_K / Q6_K experts (gguf_convert.KEPT_EXPERT_KQUANTS), w13 and w2 apart


def quantize_stack(weights: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``weights [E, N, K]`` -> (codes, scales) stacked per expert: int8 ``[E, N, K]`` + fp32 ``[E, N]``, or
    int4 ``[E, N, K/2]`` uint8 + fp16 ``[E, N, K/32]``."""
    quantize = quantize_int4 if method == "int4" else quantize_int8
    codes, scales = zip(*(quantize(w) for w in weights), strict=True)
    return torch.stack(codes), torch.stack(scales)


class QuantizedExperts(nn.Module):
    """``FusedExperts`` with quantized weights (buffers ``w13_q``, ``w13_s``, ``w2_q``, ``w2_s``, see
    ``quantize_stack``): ``forward(x [T, H], weights [T, k], ids [T, k]) -> [T, H]`` in ``x``'s dtype.

    ``method`` is the format of both stacks, or of w13 when ``w2_method`` (the K-quant formats) differs.
    ``dense`` is the torch path's dequantized ``(w13, w2)`` (None until a forward pass needs it).

    Raises:
        ValueError: ``method`` is not ``int8`` or ``int4``.
    """

    dense: tuple[torch.Tensor, torch.Tensor] | None = None
    w2_method: str | None = None  # None: ``method``

    def __init__(self, experts: FusedExperts, method: str) -> None:
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"quantization must be one of {METHODS}, got {method!r}")
        hidden = experts.w13.shape[2]
        self.num_experts, self.intermediate = experts.num_experts, experts.intermediate
        self.method = "int4" if method == "int4" and hidden % GROUP == 0 and self.intermediate % GROUP == 0 else "int8"
        with torch.no_grad():
            w13_q, w13_s = quantize_stack(experts.w13.detach(), self.method)
            w2_q, w2_s = quantize_stack(experts.w2.detach(), self.method)
        self._register(w13_q, w13_s, w2_q, w2_s)

    def _register(self, *tensors: torch.Tensor) -> None:
        for name, tensor in zip(("w13_q", "w13_s", "w2_q", "w2_s"), tensors, strict=True):
            self.register_buffer(name, tensor)

    @classmethod
    def empty(cls, method: str, num_experts: int, hidden: int, intermediate: int,
              w2_method: str | None = None) -> QuantizedExperts:
        """Uninitialized experts in a GGUF block format (``GGUF_FORMATS``, or ``KQUANT_FORMATS`` with w2 in
        ``w2_method`` when given) for the loader to fill with the file's codes (``checkpoint_parts``).

        Raises:
            ValueError: another ``method`` or pair, or sizes that are not multiples of the format's block (32, 256).
        """
        w2 = w2_method or method
        if not (method in GGUF_FORMATS and w2 == method) and not (method in KQUANT_FORMATS and w2 in KQUANT_FORMATS):
            raise ValueError(f"expert codes must be one of {GGUF_FORMATS}, or w13 and w2 each one of "
                             f"{KQUANT_FORMATS}, got {method!r} / {w2!r}")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.num_experts, self.intermediate, self.method = num_experts, intermediate, method
        self.w2_method = w2 if w2 != method else None
        parts = []
        for fmt, n, k in ((method, 2 * intermediate, hidden), (w2, hidden, intermediate)):
            shapes = quantized_shapes(fmt, n, k)
            parts += [torch.empty(num_experts, *shapes[p][0], dtype=shapes[p][1]) for p in ("qweight", "scale")]
        self._register(*parts)
        return self

    def checkpoint_parts(self, prefix: str) -> list[tuple[str, torch.Tensor]]:
        """``(tensor name, destination view)`` of the stacked layout ``prefix.{gate,up,down}_proj.{qweight,scale}``
        (what ``gguf_convert`` writes for kept ``ffn_*_exps``): gate and up fill ``w13``'s two row halves."""
        i = self.intermediate
        out = []
        for part, w13, w2 in (("qweight", self.w13_q, self.w2_q), ("scale", self.w13_s, self.w2_s)):
            out += [(f"{prefix}.gate_proj.{part}", w13[:, :i]), (f"{prefix}.up_proj.{part}", w13[:, i:]),
                    (f"{prefix}.down_proj.{part}", w2)]
        return out

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13 [E, 2I, H], w2 [E, H, I])`` dequantized to ``dtype`` (the torch path and the tests' oracle)."""
        stacks = ((self.method, self.w13_q, self.w13_s), (self.w2_method or self.method, self.w2_q, self.w2_s))
        return tuple(torch.stack([dequantize_weight(fmt, q, s) for q, s in zip(codes, scales, strict=True)])
                     .to(dtype) for fmt, codes, scales in stacks)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        kquant = self.method in KQUANT_FORMATS
        op = "moe_kquant" if kquant else f"moe_{self.method}"
        if x.dtype == torch.bfloat16 and registry.use(op, x.shape[0]):
            tensors = (x, self.w13_q, self.w13_s, self.w2_q, self.w2_s, weights, ids)
            if kquant:
                return kernels.moe_kquant(*tensors, self.method, self.w2_method or self.method)
            return getattr(kernels, op)(*tensors)
        compute = registry.torch_compute_dtype(x.dtype)
        if self.dense is None or self.dense[0].dtype != compute:
            self.dense = self.dequantized(compute)
        return moe_grouped(x.to(compute), *self.dense, weights, ids).to(x.dtype)

    def extra_repr(self) -> str:
        w2 = f", w2_method={self.w2_method}" if self.w2_method else ""
        return f"experts={self.num_experts}, intermediate={self.intermediate}, method={self.method}{w2}"


def quantize_experts(model: nn.Module, method: str) -> None:
    """Replace every ``FusedExperts`` of ``model`` with a ``QuantizedExperts`` of ``method``.

    Changes: ``model``'s modules in place (the float experts are freed unless shared elsewhere).
    """
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, FusedExperts)]
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, QuantizedExperts(module, method))


def use_quantized_experts(model: nn.Module, formats: dict[str, str]) -> None:
    """Give each MoE block whose checkpoint stores its experts' codes (``formats``: config.json's
    ``tandem_quantized`` modules; gate and up in one format, down in the same one or, for the K-quant
    formats, the other) empty ``QuantizedExperts`` to load them into.

    Changes: ``model``'s modules in place.
    """
    for name, block in list(model.named_modules()):
        if not isinstance(block, SparseMoeBlock):
            continue
        prefix = block.checkpoint_prefix(name)
        gate, up, down = (formats.get(f"{prefix}.experts.{p}_proj") for p in ("gate", "up", "down"))
        if gate is not None and gate == up and down is not None:
            moe, hidden = block.moe, block.router.shape[1]
            block.experts = QuantizedExperts.empty(gate, moe.num_experts, hidden, moe.intermediate_size, down)
