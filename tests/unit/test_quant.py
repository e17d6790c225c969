"""Weight-only int8 / int4 quantization: formats, kernels vs the dequantized oracle, model accuracy.

Bounds:
  int8 round trip  |w - q s| <= s / 2 per row (round to nearest; nothing clips at 127 = max / s).
  int4 round trip  |w - q d| <= |d| per group (half a step, or one step where +8|d| clips to 7).
  layers           QuantizedLinear (kernel or dequantize + F.linear) vs fp32 ``x @ dequant(w).T``: the
                   output's bf16 rounding (2^-8 relative) plus fp32 summation error; a path that rounds
                   the dequantized weights to bf16 adds 2^-9 * (|x| @ |w|.T); where the kernel rounds x to
                   int8 per block of 32 as llama.cpp does (avx2 always; avx512_bf16 for q8_0 at one
                   token) at most sum_b max|x_b| / 254 * sum_j |w_bj| more. The kernels themselves are
                   tested per variant in test_kernels_linear.py.
  model            stories260K (real weights): bf16 + int8/int4 logits vs float32 weights along a greedy
                   continuation; thresholds are the measured values with margin (see the test).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tandem import kernels
from tandem.config import ConfigError, ModelConfig
from tandem.kernels import registry
from tandem.models.layers import Linear
from tandem.models.quant import (
    QuantizedLinear,
    dequantize_int4,
    dequantize_int8,
    dequantize_weight,
    quantize_int4,
    quantize_int8,
    quantize_model,
)

needs_kernels = pytest.mark.skipif(not kernels.available("linear_int8"),
                                   reason=f"kernels: {kernels.unavailable_reason('linear_int8')}")


def test_int8_round_trip_is_within_half_a_step() -> None:
    w = torch.randn(37, 45, generator=torch.Generator().manual_seed(0))
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (37,) and q.abs().max() == 127
    assert ((w - dequantize_int8(q, s)).abs() <= s[:, None] / 2 + 1e-7).all()


def test_int4_packs_like_q4_0_and_round_trips_within_a_step() -> None:
    q = torch.arange(32) % 16  # stored values 0 .. 15, i.e. q - 8 = -8 .. 7
    row = 2.0 * (q - 8)  # the value of largest magnitude is -16, so d = -16 / -8 = 2
    packed, d = quantize_int4(row[None])
    assert d.dtype == torch.float16 and d.tolist() == [[2.0]]
    expected = (q[:16] | (q[16:] << 4)).tolist()
    assert packed.dtype == torch.uint8 and packed[0].tolist() == expected
    w = torch.randn(9, 96, generator=torch.Generator().manual_seed(1))
    packed, d = quantize_int4(w)
    step = d.float().repeat_interleave(32, dim=1).abs()
    assert packed.shape == (9, 48) and d.shape == (9, 3)
    assert ((w - dequantize_int4(packed, d)).abs() <= step * 1.001).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(torch.zeros(2, 40))


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), w, None if bias is None else bias.float())


def activation_error_bound(x: torch.Tensor, w: torch.Tensor, method: str, tokens: int | None = None
                           ) -> torch.Tensor | float:
    """``[M, N]``: ``sum_b max|x_b| / 254 * sum_j |w_bj|`` (blocks of 32 along K, the last one zero-padded),
    the most rounding x to int8 per block changes ``x @ w.T``, where the selected kernel of ``method`` does
    that in a call with ``tokens`` rows (default ``M``); else 0."""
    from tandem.kernels.build import cpu_flags

    k = x.shape[1]
    m = x.shape[0] if tokens is None else tokens
    quantizes = kernels.available(f"linear_{method}") and m <= kernels.linear_max_tokens() and (
        kernels.backend() == "avx2" or (method == "q8_0" and "avx512_vnni" in cpu_flags()
                                        and os.environ.get("TANDEM_Q8_0_EXACT") != "1"))
    if not quantizes:
        return 0.0
    pad = -k % 32
    amax = F.pad(x.float().abs(), (0, pad)).view(x.shape[0], -1, 32).amax(dim=2)
    return (amax / 254) @ F.pad(w.abs(), (0, pad)).view(w.shape[0], -1, 32).sum(dim=2).T


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_linear_paths_agree_and_replace_every_linear(method: str) -> None:
    g = torch.Generator().manual_seed(2)
    layer = Linear(64, [32, 16], True, torch.bfloat16, ("a", "b"))
    layer.weight.data.copy_(torch.randn(48, 64, generator=g))
    layer.bias.data.copy_(torch.randn(48, generator=g))
    model = torch.nn.Sequential(layer, Linear(48, 40, False, torch.bfloat16))
    model[1].weight.data.copy_(torch.randn(40, 48, generator=g))
    quantize_model(model, method)
    assert all(isinstance(m, QuantizedLinear) for m in model)
    assert model[0].method == method and model[1].method == "int8"  # 48 is not a multiple of 32
    assert model[0].output_sizes == [32, 16] and model[0].shard_names == ("a", "b")
    x = torch.randn(20, 64, generator=g).bfloat16()
    small, large = model[0](x[:3]), model[0](x)[:3]  # 3 tokens: kernel; 20: avx2 kernel, else dequantize + F.linear
    w = model[0].dequantized(torch.float32)
    ref = reference(x[:3], w, model[0].bias)
    bound = 2**-8 * ref.abs() + 2**-8 * (x[:3].float().abs() @ w.abs().T)  # + bf16 weights on one path
    for y, tokens in ((small, 3), (large, 20)):
        act = activation_error_bound(x[:3], w, method, tokens)
        assert ((y.float() - ref).abs() <= bound + act).all()


def test_config_rejects_unknown_quantization() -> None:
    with pytest.raises(ConfigError, match="quantization must be one of"):
        ModelConfig(quantization="int3")


@pytest.fixture(scope="module")
def stories_logits(stories_dir):
    """Logits of stories260K at every position of its own float32 greedy continuation (125 tokens):
    float32 weights (the reference), and bf16 with int8 / int4 weights (the kernels' dtype)."""
    from tandem import LLM, SamplingParams
    from tandem.config import CacheConfig, EngineConfig
    from tandem.worker.model_runner import ModelRunner

    llm = LLM(str(stories_dir), dtype="float32", progress=False)
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=120))[0]
    tokens = out.prompt_token_ids + list(out.outputs[0].token_ids)
    logits = {}
    for dtype, method in (("float32", None), ("bfloat16", "int8"), ("bfloat16", "int4")):
        config = EngineConfig(model=ModelConfig(model=str(stories_dir), dtype=dtype, quantization=method),
                              cache=CacheConfig(num_blocks=16))
        logits[method] = ModelRunner(stories_dir, config, progress=False).prompt_logits(tokens)
    return logits


# Measured when written: int8 1.0% / 100% / 100%, int4 10% / 86% / 100%.
@pytest.mark.parametrize(("method", "max_rel", "min_agree"), [("int8", 0.03, 0.95), ("int4", 0.2, 0.75)])
def test_quantized_stories_logits_stay_close(stories_logits, method: str, max_rel: float, min_agree: float) -> None:
    """Relative logit error, greedy agreement, and each greedy token within the reference's top 5."""
    base, quant = stories_logits[None], stories_logits[method]
    rel = (quant - base).norm() / base.norm()
    greedy = quant.argmax(-1)
    agree = (greedy == base.argmax(-1)).float().mean()
    in_top5 = (torch.topk(base, 5, dim=-1).indices == greedy[:, None]).any(-1).float().mean()
    assert rel < max_rel, f"{method}: relative logit error {rel:.3f}"
    assert agree >= min_agree, f"{method}: greedy agreement {agree:.2f}"
    assert in_top5 >= 0.97, f"{method}: greedy token in the reference top 5 at {in_top5:.2f} of positions"


# ---- GGUF formats kept as they are: q8_0 (group-32 int8) and q4_1 (group-32 asymmetric int4) ----

def random_codes(method: str, n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random codes and fp16 scales (q4_1: (d, m) pairs) of a ``method`` layer, as a GGUF file would hold them."""
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.001).half()
    if method == "q8_0":
        return torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g), d
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    if method == "q4_1":
        return packed, torch.stack([d, (torch.randn(n, k // 32, generator=g) * 0.05).half()], dim=2)
    return packed, d


def test_q8_0_and_q4_1_dequantize_to_the_ggml_formulas() -> None:
    g = torch.Generator().manual_seed(5)
    q, d = random_codes("q8_0", 3, 64, g)
    w = dequantize_weight("q8_0", q, d)
    assert w[2, 40].item() == q[2, 40].item() * d[2, 1].float().item()
    packed, dm = random_codes("q4_1", 3, 64, g)
    w = dequantize_weight("q4_1", packed, dm)
    d, m = dm[1, 1, 0].float().item(), dm[1, 1, 1].float().item()  # row 1, group 1: (d, m)
    byte = packed[1, 16 + 5].item()  # group 1, byte 5: weight 5 in the low nibble, weight 21 in the high one
    assert w[1, 32 + 5].item() == (byte & 0xF) * d + m
    assert w[1, 32 + 21].item() == (byte >> 4) * d + m


@needs_kernels
@pytest.mark.parametrize("method", ["q8_0", "q4_1", "int4"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 5, 32), (1, 67, 96), (2, 64, 576), (5, 33, 1056), (16, 129, 2080),
                                           (40, 70, 160)])
@pytest.mark.parametrize("bias", [False, True])
def test_group_kernels_match_dequantized_weights(method: str, m: int, n: int, k: int, bias: bool) -> None:
    """Kernels (M <= ``linear_max_tokens()``: every M on avx2) and the dequantize + oneDNN path (M = 40 on
    avx512_bf16) vs fp32 ``x @ dequant(w).T``.

    Bound: the output's bf16 rounding (2^-8 relative) plus each weight's bf16 rounding where the path
    dequantizes to bf16 (2^-9 of ``|x| @ |w|.T``) plus fp32 summation (1e-5 of ``|x| @ |w|.T``) plus
    ``activation_error_bound`` where the kernel quantizes x.
    """
    g = torch.Generator().manual_seed(m * n + k)
    codes = random_codes(method, n, k, g)
    layer = QuantizedLinear.empty(method, k, [n], bias, torch.bfloat16)
    for name, tensor in zip(("qweight", "scale"), codes, strict=True):
        getattr(layer, name).copy_(tensor)
    if bias:
        layer.bias.copy_(torch.randn(n, generator=g))
    x = torch.randn(m, k, generator=g).bfloat16()
    w = dequantize_weight(method, *codes)
    ref = reference(x, w, layer.bias)
    y = layer(x)
    mag = x.float().abs() @ w.abs().T
    act = activation_error_bound(x, w, method)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert ((y.float() - ref).abs() <= 2**-8 * ref.abs() + 2**-9 * mag + act + 1e-5 * mag + 1e-6).all()
    if method != "int4" and registry.use(f"linear_{method}", tokens=m):  # one-buffer rows = contiguous arrays
        assert layer.qweight.stride(0) > layer.qweight.shape[1]
        op = kernels.linear_q8_0 if method == "q8_0" else kernels.linear_q4_1
        assert torch.equal(op(x, *codes, layer.bias), y)


def test_empty_layer_shapes_and_bad_formats() -> None:
    layer = QuantizedLinear.empty("q4_1", 64, [32, 16], False, torch.bfloat16, ("a", "b"))
    assert layer.qweight.shape == (48, 32) and layer.scale.shape == (48, 2, 2)
    assert layer.output_sizes == [32, 16] and layer.shard_names == ("a", "b") and layer.bias is None
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedLinear.empty("q8_0", 40, [8], False, torch.bfloat16)
    with pytest.raises(ValueError, match="must be one of"):
        QuantizedLinear.empty("q5_1", 64, [8], False, torch.bfloat16)
    k_quant = QuantizedLinear.empty("q4_k", 512, [8], False, torch.bfloat16)  # 2 blocks of 144 bytes: 4 + 140
    assert k_quant.qweight.shape == (8, 280) and k_quant.scale.shape == (8, 2, 2)
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantizedLinear.empty("q6_k", 288, [8], False, torch.bfloat16)
