"""Sparse mixture-of-experts feed-forward blocks (Shazeer et al. 2017; Mixtral, Qwen-MoE, OLMoE, Granite-MoE).

A ``SparseMoeBlock`` scores every token against ``E`` experts with a linear router, keeps the
``top_k`` best (``MoEConfig.scoring``), runs each chosen expert's SwiGLU MLP on the tokens routed to
it, and sums the expert outputs weighted by their router weights. Qwen2-MoE adds a shared expert
(a dense SwiGLU MLP every token goes through) scaled by ``sigmoid(shared_expert_gate(x))``.

Experts are stored stacked, as transformers 5 holds them in memory: ``w13 [E, 2 * I, H]`` (gate rows
then up rows) and ``w2 [E, H, I]``. The loader fills them from any of the checkpoint layouts listed
by ``checkpoint_targets`` (per-expert tensors, transformers 5's fused tensors, Granite's
``input_linear`` / ``output_linear``, and the stacked ``experts.{gate,up,down}_proj`` that
``gguf_convert`` writes for llama.cpp's ``ffn_*_exps``).

Batch invariance: each (token, expert) product is computed by a kernel whose result does not depend
on how many tokens share the expert (``kernels.moe_bf16`` or ``kernels.linear_bf16``; the float32
torch path uses ``F.linear``), and a token's expert outputs are summed in float32 in its top-k order,
so a token's result does not depend on the rest of the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem import kernels
from tandem.kernels import registry
from tandem.models.hf_config import HFModelConfig, MoEConfig
from tandem.models.layers import Linear, SiluAndMul

Target = tuple[str, torch.Tensor]  # (checkpoint tensor name, the view of a parameter it fills)


def route(logits: torch.Tensor, moe: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing: ``logits [T, E]`` -> ``(weights [T, k] float32, expert ids [T, k] int64)``.

    The ids are ordered by decreasing score (``torch.topk``), the order in which a token's expert
    outputs are summed. See ``MoEConfig.scoring`` for the two rules.
    """
    logits = logits.float()
    if moe.scoring == "topk_softmax":
        top, ids = logits.topk(moe.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    probs = torch.softmax(logits, dim=-1)
    top, ids = probs.topk(moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top, ids


def moe_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Experts' weighted sum in plain PyTorch, one (token, slot) at a time in float32.

    ``x [T, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]``, ``weights [T, k]``, ``ids [T, k]`` -> ``[T, H]``
    in ``x.dtype``. The oracle of the kernels' tests and the path for float32 models.
    """
    out = torch.zeros(x.shape, dtype=torch.float32)
    for slot in range(ids.shape[1]):
        for expert in ids[:, slot].unique().tolist():
            rows = (ids[:, slot] == expert).nonzero().flatten()
            gate, up = F.linear(x[rows], w13[expert]).float().chunk(2, dim=-1)
            h = (F.silu(gate) * up).to(x.dtype)
            y = F.linear(h, w2[expert]).float()
            out[rows] += weights[rows, slot, None] * y
    return out.to(x.dtype)


def moe_grouped(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """``moe_reference``'s result with tokens grouped by expert: one pair of GEMMs per selected expert.

    Same shapes as ``moe_reference``. bf16 GEMMs run ``kernels.linear_bf16`` where the registry allows
    it (its rows do not depend on how many tokens share the call); a token's expert outputs are summed
    in float32 in its top-k order.
    """
    t, k = ids.shape
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    y = torch.empty(t * k, x.shape[1], dtype=torch.float32)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        assignments = order[start : start + n]
        rows = x[assignments // k]
        h = _silu_mul(_linear(rows, w13[expert])).to(x.dtype)
        y[assignments] = _linear(h, w2[expert]).float()
        start += n
    y = y.view(t, k, -1) * weights.float().unsqueeze(-1)
    out = y[:, 0].clone()
    for slot in range(1, k):  # NOTE: a fixed order per token, whatever the batch
        out += y[:, slot]
    return out.to(x.dtype)


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and registry.use("linear_bf16", tokens=x.shape[0]):
        return kernels.linear_bf16(x, w, None)
    return F.linear(x, w)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return F.silu(gate) * up


class FusedExperts(nn.Module):
    """``E`` SwiGLU experts stacked: ``forward(x [T, H], weights [T, k], ids [T, k]) -> [T, H]``.

    bf16 models run ``kernels.moe_bf16`` where the registry has it (tokens grouped by expert in C++,
    each selected expert's weights read once per call for all its tokens, one OpenMP team);
    otherwise ``moe_grouped``.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and self.w13.dtype == torch.bfloat16 and registry.use("moe_bf16", x.shape[0]):
            return kernels.moe_bf16(x, self.w13, self.w2, weights, ids)
        return moe_grouped(x, self.w13, self.w2, weights, ids)


class SwiGLU(nn.Module):
    """A dense SwiGLU MLP with a fused gate/up projection (Qwen2-MoE's shared expert)."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, [intermediate, intermediate], False, dtype, ("gate_proj", "up_proj"))
        self.act = SiluAndMul()
        self.down_proj = Linear(intermediate, hidden, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.act.forward(self.gate_up_proj.forward(x)))


class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's gated shared expert): ``forward(x [T, H]) -> [T, H]``.

    Args:
        cfg: the checkpoint config (``cfg.moe`` must be set).
        dtype: parameter dtype.
        layout: the family's checkpoint names, one of ``LAYOUTS``.
    """

    # family -> (the block's checkpoint module name, router weight, per-expert gate / up / down names)
    LAYOUTS = {
        "qwen": ("mlp", "gate.weight", ("gate_proj", "up_proj", "down_proj")),
        "mixtral": ("block_sparse_moe", "gate.weight", ("w1", "w3", "w2")),
        "granite": ("block_sparse_moe", "router.layer.weight", ()),
    }

    def __init__(self, cfg: HFModelConfig, dtype: torch.dtype, layout: str) -> None:
        super().__init__()
        assert cfg.moe is not None
        self.moe, self.layout = cfg.moe, layout
        self.router = nn.Parameter(torch.empty(cfg.moe.num_experts, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.experts = FusedExperts(cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size, dtype)
        shared = cfg.moe.shared_expert_intermediate_size
        self.shared_expert = SwiGLU(cfg.hidden_size, shared, dtype) if shared else None
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, False, dtype) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: the router on the kernels too: a torch matmul between two kernels waits for torch's own
        # (passive) OpenMP thread to wake, 4-6 ms per call at decode on 2 loaded cores against 0.14 ms on one.
        weights, ids = route(_linear(x, self.router), self.moe)
        out = self.experts.forward(x, weights, ids)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate.forward(x).float())
            out = (out.float() + gate * self.shared_expert.forward(x).float()).to(x.dtype)
        return out

    def checkpoint_prefix(self, module_name: str) -> str:
        """The checkpoint module name of the block ``module_name`` (e.g. ``model.layers.0.block_sparse_moe``)."""
        parent = module_name.rpartition(".")[0]
        ckpt_name = self.LAYOUTS[self.layout][0]
        return f"{parent}.{ckpt_name}" if parent else ckpt_name

    def checkpoint_targets(self, module_name: str) -> list[list[Target]]:
        """Alternative ways the checkpoint may hold the router and experts of the block ``module_name``.

        Each alternative lists ``(tensor name, destination view)`` pairs; the loader takes the first
        alternative whose tensors are all present. The shared expert's ``Linear`` layers are loaded
        the usual way and are not listed.
        """
        _, router_name, names = self.LAYOUTS[self.layout]
        gate, up, down = names or (None, None, None)
        prefix = self.checkpoint_prefix(module_name)
        router = [(f"{prefix}.{router_name}", self.router)]
        if not isinstance(self.experts, FusedExperts):  # a GGUF's expert codes (models.moe_quant.QuantizedExperts)
            return [router + self.experts.checkpoint_parts(f"{prefix}.experts")]
        w13, w2, inter = self.experts.w13, self.experts.w2, self.experts.intermediate
        fused = [(f"{prefix}.experts.gate_up_proj", w13), (f"{prefix}.experts.down_proj", w2)]
        # what gguf_convert writes for llama.cpp's ffn_{gate,up,down}_exps
        stacked = [(f"{prefix}.experts.gate_proj", w13[:, :inter]), (f"{prefix}.experts.up_proj", w13[:, inter:]),
                   (f"{prefix}.experts.down_proj", w2)]
        alternatives = [router + fused, router + stacked]
        if self.layout == "granite":
            legacy = [(f"{prefix}.input_linear.weight", w13), (f"{prefix}.output_linear.weight", w2)]
            alternatives.append(router + legacy)
        else:
            per_expert = []
            for e in range(self.experts.num_experts):
                base = f"{prefix}.experts.{e}"
                per_expert += [(f"{base}.{gate}.weight", w13[e, :inter]), (f"{base}.{up}.weight", w13[e, inter:]),
                               (f"{base}.{down}.weight", w2[e])]
            alternatives.insert(0, router + per_expert)
        return alternatives
