"""EngineCore on the tiny random Llama: a failed step, a KV round trip between engines, two engines in
one process, and the draft cache in the memory check. Token ids are compared exactly (float32)."""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path

import psutil
import pytest
import torch

from tandem.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from tandem.engine.core import EngineCore
from tandem.errors import EngineStepError
from tandem.request import Request
from tandem.sampling_params import SamplingParams
from tandem.worker.model_runner import ModelRunner

PROMPT = [1, 17, 33, 5, 90, 12, 64, 3, 77, 41, 8, 100, 23, 56]  # 3 full blocks of 4 + 2 tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def make_config(model_dir: Path, seed: int = 0, spec: SpeculativeConfig | None = None) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", seed=seed),
        cache=CacheConfig(block_size=4, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=256), num_threads=1, speculative=spec,
    )


def make_request(rid: str, params: SamplingParams = GREEDY, prompt: list[int] = PROMPT) -> Request:
    return Request(rid, list(prompt), params, eos_token_ids=frozenset({2}), max_tokens=params.max_tokens)


def run(core: EngineCore, *requests: Request, add: bool = True) -> list[list[int]]:
    for r in requests:
        if add:
            core.add_request(r)
    while core.has_unfinished_requests():
        core.step()
    core.scheduler.check()
    return [r.output_token_ids for r in requests]


@pytest.fixture(scope="module")
def fresh_tokens(tiny_llama_dir: Path) -> list[int]:
    (tokens,) = run(EngineCore(tiny_llama_dir, make_config(tiny_llama_dir), progress=False), make_request("ref"))
    assert len(tokens) == 8
    return tokens


def test_step_that_raises_mid_forward_leaves_no_poisoned_prefix(tiny_llama_dir, fresh_tokens, monkeypatch):
    core = EngineCore(tiny_llama_dir, make_config(tiny_llama_dir), progress=False)
    core.add_request(make_request("x"))

    def boom(*args, **kwargs):
        raise RuntimeError("simulated failure in the last layer")

    # NOTE: layer 0 writes its K/V of the 3 full blocks, the last layer never does.
    monkeypatch.setattr(core.runner.model.model.layers[-1], "forward", boom)
    with pytest.raises(RuntimeError) as failed:
        core.step()
    monkeypatch.undo()
    core.abort_requests(["x"])  # what a caller had to do before the engine rolled back itself
    (tokens,) = run(core, make_request("y"))
    assert tokens == fresh_tokens
    assert core.stats().prefix_cache_hits == 0
    assert isinstance(failed.value, EngineStepError) and failed.value.request_ids == ["x"]


@pytest.mark.parametrize("with_draft", [False, True])
def test_kv_round_trip_between_engines_decodes_identically(tiny_llama_dir, fresh_tokens, with_draft):
    spec = SpeculativeConfig(method="draft", speculative_model=str(tiny_llama_dir), num_speculative_tokens=2) \
        if with_draft else None
    prefill = EngineCore(tiny_llama_dir, make_config(tiny_llama_dir, spec=spec), progress=False)
    held = make_request("p", SamplingParams(temperature=0.0, max_tokens=1))
    held.kv_lease_id = "lease-p"
    run(prefill, held)
    kv = prefill.scheduler.kv_cache_manager
    block_ids = kv.held_block_ids("lease-p")
    buffers = prefill.runner.read_kv_blocks(block_ids[:3])  # the 3 full blocks = 12 tokens
    assert [tuple(b.shape) for b in buffers] == [(2, 2, 3, 4, 2, 16)] * (2 if with_draft else 1)
    kv.release("lease-p")
    assert kv.num_free_blocks == kv.num_blocks

    class Connector:
        ready: list[str] = []

        def ready_request_ids(self) -> list[str]:
            ready, Connector.ready = Connector.ready, []
            return ready

    decode = EngineCore(tiny_llama_dir, make_config(tiny_llama_dir, spec=spec), progress=False,
                        kv_connector=Connector())
    request = make_request("d")
    table = decode.scheduler.add_remote_kv_request(request, 12)
    decode.runner.write_kv_blocks(table, buffers)
    for got, sent in zip(decode.runner.read_kv_blocks(table), buffers, strict=True):
        assert torch.equal(got, sent)
    Connector.ready.append("d")
    (tokens,) = run(decode, request, add=False)
    assert tokens == fresh_tokens
    assert decode.stats().prefix_cache_hits == 0  # the KV came from the transfer, not a prefix hit

    # Control: KV that is wrong changes the output, so the transferred KV was really used.
    control = EngineCore(tiny_llama_dir, make_config(tiny_llama_dir, spec=spec), progress=False,
                         kv_connector=Connector())
    wrong = make_request("w")
    table = control.scheduler.add_remote_kv_request(wrong, 12)
    control.runner.write_kv_blocks(table, [torch.randn_like(b) for b in buffers])
    Connector.ready.append("w")
    assert run(control, wrong, add=False)[0] != fresh_tokens


def test_two_engines_in_one_process_interleave_like_solo_runs(tiny_llama_dir):
    sampled = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)  # unseeded: engine generator

    def engine(seed: int) -> EngineCore:
        return EngineCore(tiny_llama_dir, make_config(tiny_llama_dir, seed=seed), progress=False)

    solo = [run(engine(seed), make_request(f"s{seed}", sampled))[0] for seed in (1, 2)]
    engines = [engine(1), engine(2)]
    requests = [make_request("i1", sampled), make_request("i2", sampled)]
    for core, request in zip(engines, requests, strict=True):
        core.add_request(request)
    torch.manual_seed(12345)  # the global generator is not what they draw from
    while any(core.has_unfinished_requests() for core in engines):
        for core in engines:
            if core.has_unfinished_requests():
                core.step()
            torch.rand(3)  # other work in the process using the global generator
    assert [r.output_token_ids for r in requests] == solo
    assert solo[0] != solo[1]


def test_draft_kv_cache_counts_in_the_memory_check(tiny_llama_dir, monkeypatch):
    spec = SpeculativeConfig(method="draft", speculative_model=str(tiny_llama_dir), num_speculative_tokens=2)
    runner = ModelRunner(tiny_llama_dir, make_config(tiny_llama_dir, spec=spec), progress=False)
    target = runner.kv_cache_bytes_per_block(4)
    draft = runner.speculator.kv_cache_bytes_per_block()
    assert target == draft == 2 * 2 * 4 * 2 * 16 * 4
    num_blocks = 1000
    # The target cache alone fits in 90% of what is available; target + draft does not.
    available = int(num_blocks * (target + draft / 2) / 0.9)
    memory = namedtuple("svmem", "available total")(available, 2 * available)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory)
    with pytest.raises(ConfigError, match=r"the KV cache needs 0\.00 GiB but only 0\.00 GiB"):
        runner.initialize_kv_cache(num_blocks)
    assert runner.kv_caches == [] and runner.speculator.draft.kv_caches == []
    runner.initialize_kv_cache(num_blocks // 2)
    assert runner.num_blocks == 500 and len(runner.speculator.draft.kv_caches) == 2
