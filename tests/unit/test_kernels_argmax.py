"""The avx2 ``argmax`` kernel (the greedy sampler's token choice) against NumPy's float64 argmax.

NumPy's ``argmax`` is the independent reference: the first index of the maximum, and the first NaN's
index when a row holds one, which is what ``torch.max(x, dim=-1).indices`` returns on CPU (the torch
path of ``sample.ops.greedy_sample``). Checked on bf16 and fp32 rows of every length class (shorter than
8 lanes, a multiple of 8, a ragged tail, the default model's 49152-token vocabulary), with ties inside
the vector body and in the tail, NaNs, all -inf rows, strided views, and rows alone vs in a batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.kernels import build, registry
from tandem.sample import ops

RUNNABLE = [v for v in ("avx2",) if build.load_variant(v) is not None]
pytestmark = pytest.mark.skipif(not RUNNABLE, reason="the avx2 kernels do not run on this CPU")


def kernel():  # noqa: ANN201
    module = build.load_variant("avx2")
    if not hasattr(module, "argmax"):
        pytest.skip("the avx2 kernels have no argmax")
    return module.argmax


def reference(x: torch.Tensor) -> list[int]:
    return np.argmax(x.double().numpy(), axis=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, vocab", [(1, 1), (1, 7), (3, 8), (2, 45), (17, 1000), (1, 49152)])
def test_argmax_matches_numpy_with_ties(rows: int, vocab: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + vocab)
    x = torch.randn(rows, vocab, generator=g).to(dtype)
    assert kernel()(x).tolist() == reference(x)
    # ties: the maximum written at two later positions (the vector body, the tail), then earlier
    for r in range(rows):
        top = float(x[r].max()) + 1.0
        for j in sorted({vocab - 1, vocab // 2, (vocab * 2) // 3}, reverse=True):
            x[r, j] = top
    out = kernel()(x)
    assert out.dtype == torch.int64 and out.tolist() == reference(x)
    assert out.tolist() == x.max(dim=-1).indices.tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_nan_inf_and_strided_rows(dtype: torch.dtype) -> None:
    x = torch.randn(5, 203, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[0, 150] = float("nan")
    x[0, 40] = float("nan")
    x[1, 202] = float("nan")  # in the tail
    x[2] = float("-inf")
    x[3, 100] = float("inf")
    x[3, 7] = float("inf")
    x[4, :] = 0.0
    x[4, 9] = -0.0
    assert kernel()(x).tolist() == reference(x) == [40, 202, 0, 7, 0]
    wide = torch.randn(4, 300, generator=torch.Generator().manual_seed(2)).to(dtype)
    view = wide[:, 13:213]  # rows 300 elements apart
    assert kernel()(view).tolist() == reference(view)


def test_argmax_of_a_row_is_the_same_alone_and_in_a_batch() -> None:
    x = torch.randn(33, 49152, generator=torch.Generator().manual_seed(3)).bfloat16()
    batch = kernel()(x).tolist()
    assert batch == [kernel()(x[r : r + 1]).item() for r in range(33)] == reference(x)


def test_argmax_rejects_bad_input() -> None:
    with pytest.raises(RuntimeError, match=r"argmax: x must be \[R, V\]"):
        kernel()(torch.zeros(2, 0))
    with pytest.raises(RuntimeError, match="argmax: bf16 or fp32 only"):
        kernel()(torch.zeros(2, 4, dtype=torch.float16))
    with pytest.raises(RuntimeError, match=r"argmax: x must be \[R, V\]"):
        kernel()(torch.zeros(4, 3).t())


def test_greedy_sample_takes_the_kernel_and_agrees_with_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel()
    x = torch.randn(4, 5000, generator=torch.Generator().manual_seed(4)).bfloat16()
    assert registry.use("argmax")
    calls = []
    real = ops.kernels.argmax
    monkeypatch.setattr(ops.kernels, "argmax", lambda t: calls.append(t.shape) or real(t))
    assert ops.greedy_sample(x).tolist() == reference(x)
    assert calls == [(4, 5000)]
    monkeypatch.setattr(registry, "use", lambda op, tokens=None: False)
    assert ops.greedy_sample(x).tolist() == reference(x)
    assert calls == [(4, 5000)]
