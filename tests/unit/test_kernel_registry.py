"""The kernel registry without a model or a compiler: variant choice per CPU flags, per-operator limits,
``--kernel-backend`` validation, the start-up line and the torch backend's dense-weight cache."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from tandem.cli import build_parser, engine_config_from_args
from tandem.config import KERNEL_BACKENDS, ConfigError, ModelConfig
from tandem.kernels import build, registry

AVX2_FLAGS = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
AVX512_FLAGS = AVX2_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}


@pytest.fixture
def fake_variant(monkeypatch):
    """``use(name, ops)``: pretend variant ``name`` (or None: no variant) is loaded and implements ``ops``."""

    def use(name: str | None, ops: tuple[str, ...] = tuple(registry.LIMITS)) -> None:
        module = types.SimpleNamespace(**{op: object() for op in ops})
        monkeypatch.setattr(build, "selected_variant", lambda: name)
        monkeypatch.setattr(build, "load_variant", lambda variant: module if variant == name else None)
        registry.cache_clear()

    yield use
    registry.cache_clear()


def test_backend_names_agree_between_config_and_build() -> None:
    assert KERNEL_BACKENDS == build.BACKENDS
    assert registry.BACKENDS == ("avx512_bf16", "avx2", "torch")


@pytest.mark.parametrize(("requested", "flags", "expected"), [
    ("auto", AVX512_FLAGS, ["avx512_bf16", "avx2"]),
    ("auto", AVX2_FLAGS, ["avx2"]),
    ("auto", frozenset({"sse4_2"}), []),
    ("avx2", AVX512_FLAGS, ["avx2"]),
    ("avx512_bf16", AVX512_FLAGS, ["avx512_bf16"]),
    ("torch", AVX512_FLAGS, []),
])
def test_candidates_follow_cpu_flags(requested: str, flags: frozenset[str], expected: list[str]) -> None:
    assert registry.candidates(requested, flags) == expected


def test_a_variant_the_cpu_cannot_run_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"'avx512_bf16' cannot run here: the CPU lacks avx512f, avx512bw, "
                                          r"avx512vl, avx512dq, avx512_bf16"):
        registry.candidates("avx512_bf16", AVX2_FLAGS)
    with pytest.raises(ConfigError, match="kernel_backend must be one of"):
        registry.candidates("avx3", AVX2_FLAGS)


def test_variant_unsupported_reason_uses_cpu_flags(monkeypatch) -> None:
    monkeypatch.setattr(build, "cpu_flags", lambda: AVX2_FLAGS)
    monkeypatch.setattr(build, "_platform_reason", lambda: None)
    assert build.variant_unsupported_reason("avx2") is None
    assert build.variant_unsupported_reason("avx512_bf16") == (
        "the CPU lacks avx512f, avx512bw, avx512vl, avx512dq, avx512_bf16")


def test_avx512_limits_are_kept(fake_variant) -> None:
    fake_variant("avx512_bf16")
    for op in ("linear_bf16", "linear_int8", "linear_int4", "linear_q8_0", "linear_q4_1", "decoder_layer"):
        assert registry.use(op, tokens=16) and not registry.use(op, tokens=17), op
    assert registry.max_tokens("paged_attention") == 16
    assert registry.use("dequantize_q4_1", tokens=4096) and registry.use("rms_norm")


def test_gguf_k_quant_linears_run_on_avx2_from_avx512(monkeypatch) -> None:
    """The avx2-only operators are routed from avx512_bf16 to the avx2 build, where they take any M;
    without an avx2 build they run on torch."""
    avx512, avx2 = types.SimpleNamespace(linear_bf16=object()), types.SimpleNamespace(linear_q4_k=object())
    monkeypatch.setattr(build, "selected_variant", lambda: "avx512_bf16")
    monkeypatch.setattr(build, "load_variant", lambda variant: {"avx512_bf16": avx512, "avx2": avx2}[variant])
    registry.cache_clear()
    try:
        assert registry.backend_for("linear_q4_k") == "avx2" and registry.use("linear_q4_k", tokens=4096)
        assert registry.backend_for("linear_q6_k") == "torch"  # not in this fake avx2 build
        assert not {"linear_q4_k", "linear_q6_k"} & set(registry.missing_ops())  # not avx512_bf16's own ops
        monkeypatch.setattr(build, "load_variant", lambda variant: avx512 if variant == "avx512_bf16" else None)
        registry.cache_clear()
        assert registry.backend_for("linear_q4_k") == "torch" and not registry.use("linear_q4_k", tokens=1)
    finally:
        registry.cache_clear()


def test_avx2_linears_take_any_token_count(fake_variant) -> None:
    fake_variant("avx2")
    assert registry.use("linear_q4_1", tokens=4096) and registry.use("linear_bf16", tokens=1)
    assert registry.max_tokens("paged_attention") == registry.UNLIMITED
    assert registry.backend_for("linear_bf16") == "avx2"


def test_an_operator_the_build_lacks_runs_on_torch(fake_variant) -> None:
    fake_variant("avx2", ops=("bind_omp_threads", "omp_thread_ids"))
    assert registry.backend_for("linear_q4_1") == "torch"
    assert not registry.use("linear_q4_1", tokens=1) and registry.max_tokens("paged_attention") == 0
    assert "linear_q4_1" in registry.missing_ops() and "bind_omp_threads" not in registry.missing_ops()


def test_torch_backend_uses_no_kernel(fake_variant) -> None:
    fake_variant(None)
    assert registry.selected() == "torch"
    assert not any(registry.use(op) for op in registry.LIMITS)
    with pytest.raises(KeyError):
        registry.use("not_an_op")


def test_native_bf16_matmul_needs_bf16_dot_products() -> None:
    assert registry.native_bf16_matmul(AVX512_FLAGS)
    assert registry.native_bf16_matmul(AVX2_FLAGS | {"amx_bf16"})
    assert not registry.native_bf16_matmul(AVX2_FLAGS)


def test_startup_line_names_the_slow_path(fake_variant, monkeypatch, caplog) -> None:
    fake_variant(None)
    monkeypatch.setattr(build, "unsupported_reason", lambda: "the CPU lacks avx2")
    with caplog.at_level(logging.INFO, logger="tandem"):
        status = registry.log_status()
    assert status.backend == "torch" and status.slow
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, f"Tandem kernels: torch (the CPU lacks avx2) - {registry.TORCH_COST}")]


def test_startup_line_of_a_partial_and_a_full_variant(fake_variant, caplog) -> None:
    fake_variant("avx2", ops=("bind_omp_threads", "omp_thread_ids", "rms_norm"))
    with caplog.at_level(logging.INFO, logger="tandem"):
        registry.log_status()
        fake_variant("avx2")
        registry.log_status()
    partial, full = caplog.records
    assert partial.levelno == logging.WARNING
    assert partial.getMessage().startswith("Tandem kernels: avx2 (AVX2+FMA+F16C); linear_bf16, linear_int8, ")
    assert partial.getMessage().endswith("not built for avx2 yet, run on torch - decode is slower")
    assert (full.levelno, full.getMessage()) == (logging.INFO, "Tandem kernels: avx2 (AVX2+FMA+F16C)")


def test_kernel_backend_flag_maps_to_model_config() -> None:
    args = build_parser().parse_args(["generate", "--prompt", "x", "--kernel-backend", "torch"])
    assert engine_config_from_args(args).model.kernel_backend == "torch"
    args = build_parser().parse_args(["generate", "--prompt", "x"])
    assert engine_config_from_args(args).model.kernel_backend is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--kernel-backend", "avx3"])
    with pytest.raises(ConfigError, match=r"kernel_backend must be one of \('auto', 'avx512_bf16', 'avx2', "
                                          r"'torch'\), got 'avx3'"):
        ModelConfig(kernel_backend="avx3")


def test_configure_sets_the_environment_for_later_processes(monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_KERNEL_BACKEND", "auto")
    cleared = []
    monkeypatch.setattr(build, "selected_variant", types.SimpleNamespace(cache_clear=lambda: cleared.append(1)))
    registry.configure(None)
    assert cleared == [] and build.requested_backend() == "auto"
    registry.configure("torch")
    assert cleared == [1] and build.requested_backend() == "torch"


def test_torch_backend_dequantizes_a_quantized_layer_once(fake_variant, monkeypatch) -> None:
    from tandem.models import quant

    fake_variant(None)
    calls = []
    real = quant.dequantize_weight
    monkeypatch.setattr(quant, "dequantize_weight", lambda *a: calls.append(a[0]) or real(*a))
    g = torch.Generator().manual_seed(0)
    layer = quant.QuantizedLinear.empty("q4_1", 64, [8], False, torch.bfloat16)
    layer.qweight.copy_(torch.randint(0, 256, layer.qweight.shape, generator=g, dtype=torch.uint8))
    layer.scale.copy_(torch.rand(layer.scale.shape, generator=g).half())
    x = torch.randn(3, 64, generator=g).bfloat16()
    outs = [layer(x[:1]), layer(x), layer(x)]
    assert calls == ["q4_1"] and layer.dense is not None
    assert layer.dense.dtype == registry.torch_compute_dtype(torch.bfloat16)
    # NOTE: the dense copy is in the compute dtype (bf16 where the CPU multiplies bf16 natively, as on
    # AVX-512 BF16), so the reference rounds the dequantized weights the same way, then sums in fp32
    dense = real("q4_1", layer.qweight, layer.scale).to(registry.torch_compute_dtype(torch.bfloat16)).float()
    ref = x.float() @ dense.T
    torch.testing.assert_close(outs[1].float(), ref, rtol=2**-8, atol=1e-3)
    assert "qweight" in layer.state_dict() and "dense" not in layer.state_dict()


def test_the_avx512_build_defines_every_operator_the_registry_declares_for_it() -> None:
    import re

    defined = set(re.findall(r'm\.def\("(\w+)"', (build.CSRC / "bindings.cpp").read_text()))
    assert defined == {op for op, limits in registry.LIMITS.items() if "avx512_bf16" in limits}
