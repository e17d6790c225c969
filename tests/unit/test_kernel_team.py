"""The avx2 kernels' worker team (csrc/avx2/parallel.cpp): results independent of the team's size and
split, the team rebuilt when the thread count changes, and a forked child that runs kernels after its
parent's team existed (the child has no workers: it must start its own team, not wait on the parent's).

References are independent: float64 ``x @ dequant(w).T`` bounds the q4_1 output (as in
``test_kernels_linear.py``), and every other thread count must give the same bits as one thread.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from tandem.kernels import build
from tandem.models import quant

pytestmark = pytest.mark.skipif(build.load_variant("avx2") is None, reason="the avx2 kernels do not run here")


def _q4_1_layer(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.001).half()
    mins = (torch.randn(n, k // 32, generator=g) * 0.05).half()
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    x = torch.randn(3, k, generator=g).bfloat16()
    return x, codes, torch.stack([d, mins], 2)


def _run(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return build.load_variant("avx2").linear_q4_1(x, codes, scale, None)


def test_results_do_not_depend_on_the_team_size() -> None:
    x, codes, scale = _q4_1_layer(1000, 576, seed=0)  # 250 tiles of 4 rows: many chunks, a ragged last one
    ref = x.double() @ quant.dequantize_weight("q4_1", codes, scale).double().T
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(x, codes, scale)
        for threads in (2, 3, 2):  # each change rebuilds the team
            torch.set_num_threads(threads)
            for _ in range(3):
                assert torch.equal(_run(x, codes, scale), one), f"{threads} threads"
    finally:
        torch.set_num_threads(before)
    # a loose sanity bound against float64 (test_kernels_linear.py checks the exact error bound)
    assert (one.double() - ref).abs().max().item() < 0.05 * ref.abs().max().item()


def _child(queue) -> None:  # noqa: ANN001
    x, codes, scale = _q4_1_layer(1000, 576, seed=0)
    torch.set_num_threads(2)
    queue.put(_run(x, codes, scale).view(torch.int16).numpy().tobytes())  # bytes: no shared-memory handle


def test_a_forked_child_runs_kernels_with_a_team_of_its_own() -> None:
    x, codes, scale = _q4_1_layer(1000, 576, seed=0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        parent = _run(x, codes, scale)  # the parent's team exists now
    finally:
        torch.set_num_threads(before)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue,))
    proc.start()
    try:
        child = queue.get(timeout=60)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
    assert child == parent.view(torch.int16).numpy().tobytes()


_YIELDING_CHILD = """
import sys, torch
from tandem.kernels import build
k = build.load_variant("avx2")
g = torch.Generator().manual_seed(1)
w = torch.randn(1000, 904, generator=g).bfloat16()  # K = 904: a ragged 16-column tail
x = torch.randn(37, 904, generator=g).bfloat16()
outs = []
for threads in (1, 2, 3):
    torch.set_num_threads(threads)
    outs += [k.linear_bf16(x[:m].contiguous(), w, None) for m in (1, 5, 37)]
torch.save(outs, sys.argv[1])
"""


def test_workers_that_yield_before_every_chunk_give_the_same_bits(tmp_path) -> None:  # noqa: ANN001
    """TANDEM_YIELD_US=1: a worker calls sched_yield() before nearly every chunk it claims (by default
    workers never yield, parallel.cpp). Outputs for 1-3 threads and M = 1 / 5 / 37
    (the decode path and the blocked GEMM) must be the bits of this process's default run, each token's
    row the same alone as in the batch, and within the bf16 rounding of a float64 ``x @ w.T``."""
    import os
    import subprocess
    import sys

    out = tmp_path / "outs.pt"
    env = {**os.environ, "TANDEM_YIELD_US": "1"}
    subprocess.run([sys.executable, "-c", _YIELDING_CHILD, str(out)], env=env, check=True, timeout=300)
    yielded = torch.load(out)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(1000, 904, generator=g).bfloat16()
    x = torch.randn(37, 904, generator=g).bfloat16()
    kernels = build.load_variant("avx2")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        here = [kernels.linear_bf16(x[:m].contiguous(), w, None) for m in (1, 5, 37)]
    finally:
        torch.set_num_threads(before)
    for i, y in enumerate(yielded):
        assert torch.equal(y, here[i % 3]), f"thread count {1 + i // 3}, M {(1, 5, 37)[i % 3]}"
    assert torch.equal(here[2][:5], here[1]) and torch.equal(here[2][:1], here[0])
    ref = x.double() @ w.double().T
    # bf16 output rounding (2^-8 relative) plus fp32 accumulation over 904 terms
    assert ((here[2].double() - ref).abs() <= ref.abs() * 2.0**-8 + 1e-3).all()
