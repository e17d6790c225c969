"""The one-call bf16 decoder layer (``kernels.decoder_layer_bf16``) against the layer's Python kernel path.

Both run the same kernels in the same order, so hidden states and KV caches must be bit-identical.
The step mixes a decode row (1 token after a 20-token prefill) and a fresh 5-token row, on tiny
random checkpoints: Llama (llama3 RoPE, biases everywhere, tied embeddings), Mistral, Qwen2 (q/k/v
bias). Qwen3 (q/k norm) and quantized linears must fall back to the Python path.
"""

from __future__ import annotations

import pytest
import torch

from tandem import kernels
from tandem.attention import AttentionMetadata
from tandem.attention.metadata import token_positions
from tandem.config import CacheConfig, EngineConfig, ModelConfig
from tandem.kernels import registry
from tandem.models.llama import LlamaModel
from tandem.models.quant import quantize_model
from tandem.worker.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(
    not kernels.available("decoder_layer_bf16"),
    reason=f"Tandem CPU kernels unavailable: {kernels.unavailable_reason('decoder_layer_bf16')}"
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
    """Prefill 20 tokens of row 0 (Python path on avx512_bf16: 20 > 16 tokens), then one step: row 0 decodes,
    row 1 runs 5."""
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


@pytest.mark.parametrize("name", ["llama", "llama3_rope", "mistral", "qwen2"])
def test_fused_layer_is_bit_identical_to_the_python_path(name: str, tiny_checkpoint_factory,  # noqa: ANN001
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    runner = bf16_runner(tiny_checkpoint_factory(name))
    model = runner.model.model
    calls = []
    real = kernels.decoder_layer_bf16
    monkeypatch.setattr(kernels, "decoder_layer_bf16", lambda *a, **k: calls.append(1) or real(*a, **k))
    fused, caches, ref, ref_caches = run_both(runner.model, runner, monkeypatch)
    # The 6-token step on every layer; the 20-token prefill too where the registry allows 20 tokens
    # (avx2: any count; avx512_bf16: 16, so that step takes the Python path).
    steps = 2 if registry.use("decoder_layer_bf16", tokens=20) else 1
    assert len(calls) == steps * len(model.layers)
    assert fused.dtype == torch.bfloat16 and fused.abs().max() > 0
    assert torch.equal(fused, ref)
    for (k, v), (rk, rv) in zip(caches, ref_caches, strict=True):
        assert torch.equal(k, rk) and torch.equal(v, rv)


@pytest.mark.parametrize("name", ["qwen3", "qwen2-int8"])
def test_fused_layer_falls_back_for_qk_norm_and_quantized_linears(name: str, tiny_checkpoint_factory,  # noqa: ANN001
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    runner = bf16_runner(tiny_checkpoint_factory(name.split("-")[0]))
    if name.endswith("int8"):
        quantize_model(runner.model, "int8")
    monkeypatch.setattr(kernels, "decoder_layer_bf16", lambda *a, **k: pytest.fail("must not be called"))
    fused, caches, ref, ref_caches = run_both(runner.model, runner, monkeypatch)
    assert torch.equal(fused, ref)
