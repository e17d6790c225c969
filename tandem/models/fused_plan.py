"""What ``kernels.decoder_layer`` needs of one decoder layer's modules, gathered once and reused.

Asking every module for its kernel arguments on every layer of every step (``kernel_linear``, ``nn.Module``
attribute look-ups, flattening the linears) cost about 55 us per layer in Python, 1.6 ms of a 19 ms decode
step of the default model (30 layers, 2 Zen 1 cores). A ``FusedLayerPlan`` holds those arguments and the
modules they came from; ``LlamaDecoderLayer.forward_fused`` reuses it while the same modules are in place
(``quantize_model`` and self-speculation's deepcopy replace modules after construction: a new plan then) and
the step's token count is covered: a linear's kernel taken for T tokens is taken for any count up to T
(the registry's limits are upper bounds), so a plan is rebuilt only when a step is longer than any before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tandem import kernels
from tandem.kernels import build


def layer_modules(layer: nn.Module) -> tuple:
    """The identities a plan depends on: ``(variant, attention, its backend, mlp, qkv, o, gate_up, down,
    input norm, post-attention norm)``; ``_modules`` is read directly (``nn.Module.__getattr__`` is slow)."""
    mods = layer._modules
    attn, mlp = mods["self_attn"], mods["mlp"]
    a, m = attn._modules, mlp._modules
    return (build.selected_variant(), attn, attn.backend, mlp, a.get("qkv_proj"), a.get("o_proj"),
            m.get("gate_up_proj"), m.get("down_proj"), mods["input_layernorm"], mods["post_attention_layernorm"])


@dataclass(frozen=True)
class FusedLayerPlan:
    """One layer's ``kernels.decoder_layer`` arguments for steps of up to ``tokens`` tokens, or ``linears``
    None: the layer does not suit the fused call, or some linear has no kernel for ``tokens`` tokens (then
    for no larger count either). ``input_norm``, ``post_norm`` ``[hidden]``, ``eps`` as the layer's norms."""

    modules: tuple
    tokens: int
    linears: kernels.FlatLinears | None = None
    input_norm: torch.Tensor | None = None
    post_norm: torch.Tensor | None = None
    eps: float = 0.0

    @classmethod
    def build(cls, modules: tuple, tokens: int, suits: bool) -> FusedLayerPlan:
        """The plan of ``layer_modules(layer)`` for ``tokens`` tokens; ``suits``: the layer's own modules
        allow the fused call (no q/k norm, ...; the layer decides)."""
        parts = []
        for module in modules[4:8] if suits else ():
            kernel_linear = getattr(module, "kernel_linear", None)
            args = kernel_linear(tokens) if kernel_linear is not None else None
            if args is None:
                break
            parts.append(args)
        if len(parts) < 4:
            return cls(modules, tokens if suits else 0)
        norm, post = modules[8], modules[9]
        return cls(modules, tokens, kernels.flatten_linears(tuple(parts)), norm.weight, post.weight, norm.eps)

    def covers(self, modules: tuple, tokens: int) -> bool:
        """Whether this plan answers for ``modules`` (the same objects) at ``tokens`` tokens."""
        if self.linears is None:
            return tokens >= self.tokens and modules == self.modules
        return tokens <= self.tokens and modules == self.modules


def fused_plan(layer: nn.Module, tokens: int, suits: Callable[[], bool]) -> FusedLayerPlan | None:
    """``layer``'s plan at ``tokens`` tokens (None: no fused call), from its cache or built (``suits()``
    then says whether the layer's modules allow the call). Changes: ``layer``'s cached plan."""
    modules = layer_modules(layer)
    plan = layer.__dict__.get("_fused_plan")
    if plan is None or not plan.covers(modules, tokens):
        plan = FusedLayerPlan.build(modules, tokens, suits())
        layer.__dict__["_fused_plan"] = plan
    return plan if plan.linears is not None else None
