"""ModelRunner bookkeeping on the tiny Llama: state lifecycle, logprobs, sizes, errors."""

from __future__ import annotations

import ctypes
import math
import platform
from pathlib import Path

import psutil
import pytest
import torch

from tandem.config import CacheConfig, ConfigError, EngineConfig, ModelConfig
from tandem.outputs import NewRequestData, ScheduledRequest, SchedulerOutput
from tandem.sampling_params import SamplingParams
from tandem.worker.cpu_env import available_cores, configure_threads
from tandem.worker.model_runner import ModelRunner, keep_freed_memory

PROMPT = [5, 9, 17, 33, 4]


@pytest.fixture(scope="module")
def runner(tiny_llama_dir: Path) -> ModelRunner:
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=16), num_threads=1,
    )
    r = ModelRunner(tiny_llama_dir, config, progress=False)
    r.initialize_kv_cache(16)
    return r


def test_sizes(runner: ModelRunner) -> None:
    # 2 (K and V) * 2 layers * 4 tokens * 2 KV heads * 16 head_dim * 4 bytes
    assert runner.kv_cache_bytes_per_block(4) == 2 * 2 * 4 * 2 * 16 * 4
    assert runner.dtype_bytes == 4 and runner.max_model_len == 256 and runner.num_blocks == 16
    assert runner.kv_caches[0][0].shape == (16, 4, 2, 16)


def test_execute_logprobs_state_and_finish(runner: ModelRunner) -> None:
    greedy = SamplingParams(temperature=0.0)
    with_lp = SamplingParams(temperature=0.0, logprobs=2)
    new = [NewRequestData("a", PROMPT, [], greedy), NewRequestData("b", PROMPT, [], with_lp)]
    rows = [
        ScheduledRequest("a", PROMPT, 0, [3, 1], sample=True),
        ScheduledRequest("b", PROMPT[:3], 0, [7], sample=False),  # a chunk: no token yet
    ]
    out = runner.execute(SchedulerOutput(scheduled=rows, new_requests=new))
    assert list(out.sampled_token_ids) == ["a"] and out.logprobs == {}
    expected = runner.prompt_logits(PROMPT)[-1].argmax().item()
    assert out.sampled_token_ids["a"] == [expected]
    assert runner.states["a"].output_token_ids == [expected]

    rows = [ScheduledRequest("b", PROMPT[3:], 3, [7, 2], sample=True)]
    out = runner.execute(SchedulerOutput(scheduled=rows))
    assert out.sampled_token_ids == {"b": [expected]}  # same prompt, chunked: same greedy token
    (position,) = out.logprobs["b"]
    assert position[expected].rank == 1 and len(position) == 2  # sampled (= top-1) + top-2
    log_probs = torch.log_softmax(runner.prompt_logits(PROMPT)[-1], -1)
    assert math.isclose(position[expected].logprob, log_probs[expected].item(), abs_tol=1e-5)

    runner.execute(SchedulerOutput(finished_request_ids={"a", "b"}))
    assert "a" not in runner.states and "b" not in runner.states


def test_execute_errors(runner: ModelRunner, tiny_llama_dir: Path) -> None:
    with pytest.raises(RuntimeError, match="'ghost' samples but was never sent"):
        runner.execute(SchedulerOutput(scheduled=[ScheduledRequest("ghost", [1], 0, [0], sample=True)]))
    too_long = ScheduledRequest("x", [1], 256, [0] * 65, sample=False)
    with pytest.raises(ValueError, match="context of 257 tokens exceeds max_model_len 256"):
        runner.execute(SchedulerOutput(scheduled=[too_long]))
    fresh = ModelRunner(tiny_llama_dir, EngineConfig(model=ModelConfig(dtype="float32")), progress=False)
    with pytest.raises(RuntimeError, match="initialize_kv_cache"):
        fresh.execute(SchedulerOutput(scheduled=[ScheduledRequest("x", [1], 0, [0], sample=False)]))
    # More KV cache than the machine has: a clear error before anything is allocated.
    blocks = 2 * psutil.virtual_memory().total // fresh.kv_cache_bytes_per_block(fresh.block_size)
    with pytest.raises(ConfigError, match=r"the KV cache needs .* GiB but only .* GiB of memory is available"):
        fresh.initialize_kv_cache(blocks)
    assert fresh.kv_caches == [] and fresh.num_blocks == 0


def test_bfloat16_runner_close_to_float32(tiny_llama_dir: Path, runner: ModelRunner) -> None:
    bf16 = ModelRunner(tiny_llama_dir, EngineConfig(model=ModelConfig(dtype="bfloat16")), progress=False)
    assert bf16.model.lm_head.dense_weight().dtype == torch.bfloat16 and bf16.dtype_bytes == 2
    ours, ref = bf16.prompt_logits(PROMPT), runner.prompt_logits(PROMPT)
    assert ours.dtype == torch.float32
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 0.05


def test_configure_threads() -> None:
    before = torch.get_num_threads()
    try:
        assert configure_threads(1) == 1 and torch.get_num_threads() == 1
        assert configure_threads(None) == available_cores() >= 1
    finally:
        torch.set_num_threads(before)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_keep_freed_memory_serves_large_blocks_from_the_heap() -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = _MallInfo2
    assert keep_freed_memory()
    size = 8 << 20  # a [16, 151936] bf16 logits tensor is 4.6 MiB; glibc's default threshold is 128 KiB
    mapped = libc.mallinfo2().hblkhd
    first = libc.malloc(size)
    assert libc.mallinfo2().hblkhd == mapped  # not a fresh mmap
    heap = libc.mallinfo2().arena
    libc.free(first)
    assert libc.mallinfo2().arena == heap  # the heap is not trimmed back to the OS
    second = libc.malloc(size)
    libc.free(second)
    assert second == first  # the freed block is reused, not returned to the OS
