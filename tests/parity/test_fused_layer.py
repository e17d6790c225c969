"""The one-call decoder layer (``kernels.decoder_layer``) against the layer's Python kernel path.

Both run the same kernels in the same order, so hidden states and KV caches must be bit-identical.
The step mixes a decode row (1 token after a 20-token prefill) and a fresh 5-token row, on tiny
random checkpoints: Llama (llama3 RoPE, biases everywhere, tied embeddings), Mistral, Qwen2 (q/k/v
bias), with bf16 linears and with quantized ones (int8, int4, GGUF q8_0 / q4_1, a GGUF-like mix, and
llama.cpp's Q4_K_M mix of Q5_0 / Q8_0 / Q4_K / Q6_K with qkv split over two formats);
the quantized layer is also checked against PyTorch ops on the dequantized weights. Qwen3 (q/k norm)
must fall back to the Python path.
"""

from __future__ import annotations

import pytest
import torch

from tandem import kernels
from tandem.attention import AttentionMetadata
from tandem.attention.metadata import token_positions
from tandem.attention.torch_ref import TorchRefAttention
from tandem.config import CacheConfig, EngineConfig, ModelConfig
from tandem.kernels import registry
from tandem.models.layers import Linear
from tandem.models.llama import LlamaModel
from tandem.models.quant import ConcatLinear, QuantizedLinear, quantize_model
from tandem.worker.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(
    not kernels.available("decoder_layer"),
    reason=f"Tandem CPU kernels unavailable: {kernels.unavailable_reason('decoder_layer')}"
)

BLOCK = 4


def bf16_runner(model_dir) -> ModelRunner:  # noqa: ANN001
    config = EngineConfig(model=ModelConfig(model=str(model_dir), dtype="bfloat16"),
                          cache=CacheConfig(block_size=BLOCK, num_blocks=32), num_threads=1)
    runner = ModelRunner(model_dir, config, progress=False)
    runner.initialize_kv_cache(32)
    return runner


def forward(model, ids: list[int], computed: list[int], scheduled: list[int], tables: list[list[int]], caches):  # noqa: ANN001, ANN201
    meta = AttentionMetadata.build(computed, scheduled, tables, BLOCK)
    positions = token_positions(torch.tensor(computed), torch.tensor(scheduled))
    with torch.no_grad():
        return model(torch.tensor(ids), positions, caches, meta)


def mixed_step(model, caches) -> torch.Tensor:  # noqa: ANN001
    """Prefill 20 tokens of row 0 (the Python path where the registry limits decoder_layer below 20), then one
    step: row 0 decodes, row 1 runs 5."""
    tables = [[7, 2, 9, 0, 4, 11], [5, 3]]
    forward(model, list(range(3, 23)), [0], [20], tables[:1], caches)
    return forward(model, [30, 40, 41, 42, 43, 44], [20, 0], [1, 5], tables, caches)


def run_both(model, runner: ModelRunner, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN001, ANN201
    caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    fused = mixed_step(model, caches)
    with monkeypatch.context() as m:
        m.setattr(LlamaModel, "fused_step", lambda self, x: False)
        ref_caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        ref = mixed_step(model, ref_caches)
    return fused, caches, ref, ref_caches


def gguf_codes(linear: Linear, method: str) -> QuantizedLinear:
    """A ``method`` (q8_0 / q4_1) layer holding the nearest GGUF codes of a float ``Linear``'s weight."""
    dense = linear.dense_weight().detach()  # packed for the packed bf16 kernel after load (pack_linears)
    w = dense.float()
    n, k = w.shape
    layer = QuantizedLinear.empty(method, k, linear.output_sizes, linear.bias is not None, dense.dtype,
                                  linear.shard_names)
    blocks = w.view(n, k // 32, 32)
    if method == "q8_0":
        d = (blocks.abs().amax(2) / 127).half()
        layer.qweight.copy_(torch.round(blocks / d.float().clamp_min(1e-8)[..., None]).clamp(-127, 127).view(n, k))
        layer.scale.copy_(d)
    else:
        lo, hi = blocks.amin(2), blocks.amax(2)
        d, m = ((hi - lo) / 15).half(), lo.half()
        u = torch.round((blocks - m.float()[..., None]) / d.float().clamp_min(1e-8)[..., None]).clamp(0, 15)
        u = u.to(torch.uint8)
        layer.qweight.copy_((u[..., :16] | (u[..., 16:] << 4)).view(n, k // 2))
        layer.scale.copy_(torch.stack([d, m], 2))
    if linear.bias is not None:
        layer.bias.copy_(linear.bias)
    return layer


def quantize_layers(model, methods: dict[str, str]) -> None:  # noqa: ANN001
    """Replaces each decoder layer's projection ``name`` by a ``methods[name]`` layer (int8 / int4 from
    ``QuantizedLinear``, q8_0 / q4_1 as ``gguf_codes``)."""
    for layer in model.model.layers:
        for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "gate_up_proj"),
                             (layer.mlp, "down_proj")):
            method = methods[name]
            linear = getattr(parent, name)
            gguf = method in ("q8_0", "q4_1")
            setattr(parent, name, gguf_codes(linear, method) if gguf else QuantizedLinear(linear, method))


def count_fused(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = kernels.decoder_layer
    monkeypatch.setattr(kernels, "decoder_layer", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def fused_steps() -> int:
    """The 6-token step on every layer; the 20-token prefill too where the registry allows 20 tokens
    (both variants take any count today; a limit below 20 would send that step to the Python path)."""
    return 2 if registry.use("decoder_layer", tokens=20) else 1


@pytest.mark.parametrize("name", ["llama", "llama3_rope", "mistral", "qwen2"])
def test_fused_layer_is_bit_identical_to_the_python_path(name: str, tiny_checkpoint_factory,  # noqa: ANN001
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    runner = bf16_runner(tiny_checkpoint_factory(name))
    model = runner.model.model
    calls = count_fused(monkeypatch)
    fused, caches, ref, ref_caches = run_both(runner.model, runner, monkeypatch)
    assert len(calls) == fused_steps() * len(model.layers)
    assert fused.dtype == torch.bfloat16 and fused.abs().max() > 0
    assert torch.equal(fused, ref)
    for (k, v), (rk, rv) in zip(caches, ref_caches, strict=True):
        assert torch.equal(k, rk) and torch.equal(v, rv)


MIXES = {  # qkv, o, gate_up, down
    "int8": ("int8",) * 4, "int4": ("int4",) * 4, "q8_0": ("q8_0",) * 4, "q4_1": ("q4_1",) * 4,
    "gguf-mix": ("q4_1", "q8_0", "q4_1", "q8_0"),  # real GGUF files mix formats within a layer
}


def mixed_quantized(runner: ModelRunner, mix: str) -> None:
    names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    quantize_layers(runner.model, dict(zip(names, MIXES[mix], strict=True)))


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_quantized_fused_layer_is_bit_identical_to_the_python_path(name: str, mix: str, tiny_checkpoint_factory,  # noqa: ANN001
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    runner = bf16_runner(tiny_checkpoint_factory(name))
    mixed_quantized(runner, mix)
    assert_fused_matches_python_path(runner, monkeypatch)


def test_linears_replaced_after_a_fused_step_are_the_ones_that_run(tiny_checkpoint_factory,  # noqa: ANN001
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Each layer keeps its fused-call arguments between steps (models/fused_plan.py); replacing its linears
    after a step (as quantize_model and self-speculation's deepcopy do) must run the new ones: a kept bf16
    plan would give the bf16 layer's hidden states, not the q4_1 Python path's."""
    runner = bf16_runner(tiny_checkpoint_factory("llama"))
    bf16 = mixed_step(runner.model, [(k.clone(), v.clone()) for k, v in runner.kv_caches])
    mixed_quantized(runner, "q4_1")
    assert not torch.equal(assert_fused_matches_python_path(runner, monkeypatch), bf16)


def assert_fused_matches_python_path(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """One fused call per layer and step, the same hidden states and caches as the Python path; returns them."""
    calls = count_fused(monkeypatch)
    fused, caches, ref, ref_caches = run_both(runner.model, runner, monkeypatch)
    assert len(calls) == fused_steps() * len(runner.model.model.layers)
    assert fused.abs().max() > 0 and torch.equal(fused, ref)
    for (k, v), (rk, rv) in zip(caches, ref_caches, strict=True):
        assert torch.equal(k, rk) and torch.equal(v, rv)
    return fused


def test_quantized_fused_layer_against_pytorch_on_dequantized_weights(tiny_checkpoint_factory,  # noqa: ANN001
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused step (GGUF-like q4_1 / q8_0 mix) against PyTorch ops only: every registry operator on
    torch (linears on the dequantized weights in fp32 where the CPU lacks bf16 dot products, norms,
    RoPE, SiLU) and gather + SDPA attention. The avx2 kernels quantize each linear's input to int8 per
    block of 32 (|error| <= max|x_b| / 254 per input, tests/unit/test_kernels_linear.py); 8 such linears
    (2 layers) on this random checkpoint put the hidden state 3.7% (of its largest value) from the
    reference, so the bound is 5%: a wrong block term, scale or order is off by tens of percent."""
    runner = bf16_runner(tiny_checkpoint_factory("qwen2"))
    mixed_quantized(runner, "gguf-mix")
    calls = count_fused(monkeypatch)
    caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    fused = mixed_step(runner.model, caches)
    assert len(calls) == fused_steps() * len(runner.model.model.layers)
    with monkeypatch.context() as m:
        m.setattr(registry, "use", lambda op, tokens=None: False)
        for layer in runner.model.model.layers:
            m.setattr(layer.self_attn, "backend", TorchRefAttention())
        ref = mixed_step(runner.model, [(k.clone(), v.clone()) for k, v in runner.kv_caches])
    assert len(calls) == fused_steps() * len(runner.model.model.layers)  # the reference ran no fused layer
    err = (fused.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert err <= 0.05, err
    if registry.backend_for("linear_q4_1") == "avx2":
        # NOTE: int8 activations cannot give the reference's bits; avx512_bf16's linears multiply the same
        # dequantized bf16 weights as the reference at this size (fp32 sums), so there equal bits may come out
        assert err > 0, "the avx2 kernels quantize activations: equal bits mean the reference ran them"


def random_codes(fmt: str, k: int, output_sizes: list[int], bias: bool, g: torch.Generator) -> QuantizedLinear:
    """A ``fmt`` layer of random GGUF codes (every byte random, fp16 fields in [1e-3, 1e-2)) and a random bias."""
    layer = QuantizedLinear.empty(fmt, k, output_sizes, bias, torch.bfloat16)
    info = torch.iinfo(layer.qweight.dtype)
    layer.qweight.copy_(torch.randint(info.min, info.max + 1, layer.qweight.shape, generator=g, dtype=torch.int64))
    layer.scale.copy_(torch.rand(layer.scale.shape, generator=g) * 9e-3 + 1e-3)
    if bias:
        layer.bias.copy_(torch.randn(layer.bias.shape, generator=g) * 0.1)
    return layer


def q4_k_m_layers(model) -> None:  # noqa: ANN001
    """llama.cpp's Q4_K_M mix of a real file (SmolLM2-135M's): qkv a ``ConcatLinear`` of q/k in Q5_0 and v in
    Q8_0, o and gate_up Q5_0, down Q4_K (layer 0) / Q6_K (layer 1). K-quants need K % 256 == 0, so gate_up
    gets 2 x 256 rows of random codes and down reads 256 (the tiny checkpoint's MLP is 96 wide)."""
    g = torch.Generator().manual_seed(0)
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q, kv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        hidden, bias = sum(attn.o_proj.output_sizes), attn.qkv_proj.bias is not None
        qk = random_codes("q5_0", hidden, [q, kv], bias, g)
        attn.qkv_proj = ConcatLinear([qk, random_codes("q8_0", hidden, [kv], bias, g)])
        attn.o_proj = random_codes("q5_0", q, [hidden], False, g)
        mlp.gate_up_proj = random_codes("q5_0", hidden, [256, 256], False, g)
        mlp.down_proj = random_codes("q4_k" if i == 0 else "q6_k", 256, [hidden], False, g)


@pytest.mark.skipif(not registry.use("linear_q4_k") or registry.backend_for("linear_q4_k") != registry.selected(),
                    reason="the fused layer takes GGUF K-quants only in the avx2 build")
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_q4_k_m_fused_layer_is_bit_identical_and_close_to_pytorch(name: str, tiny_checkpoint_factory,  # noqa: ANN001
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Q5_0 / Q8_0 / Q4_K / Q6_K linears, qkv split over two formats: one fused call per layer and step,
    the same bits as the Python path, and within 5% of PyTorch ops on the dequantized weights (as for the
    gguf-mix above; measured 1-2% here)."""
    runner = bf16_runner(tiny_checkpoint_factory(name))
    q4_k_m_layers(runner.model)
    fused = assert_fused_matches_python_path(runner, monkeypatch)
    with monkeypatch.context() as m:
        m.setattr(registry, "use", lambda op, tokens=None: False)
        for layer in runner.model.model.layers:
            m.setattr(layer.self_attn, "backend", TorchRefAttention())
        torch_ref = mixed_step(runner.model, [(k.clone(), v.clone()) for k, v in runner.kv_caches])
    err = (fused.float() - torch_ref.float()).abs().max() / torch_ref.float().abs().max()
    assert 0 < err <= 0.05, err


@pytest.mark.parametrize("name", ["qwen3", "qwen3-int8"])
def test_fused_layer_falls_back_for_qk_norm(name: str, tiny_checkpoint_factory,  # noqa: ANN001
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    runner = bf16_runner(tiny_checkpoint_factory(name.split("-")[0]))
    if name.endswith("int8"):
        quantize_model(runner.model, "int8")
    monkeypatch.setattr(kernels, "decoder_layer", lambda *a, **k: pytest.fail("must not be called"))
    fused, caches, ref, ref_caches = run_both(runner.model, runner, monkeypatch)
    assert torch.equal(fused, ref)
