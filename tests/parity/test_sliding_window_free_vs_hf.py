"""Mistral with a 16-token window in every layer: the engine frees the KV blocks out of the window while
requests run (``KVCacheManager``), and its greedy tokens stay transformers' own.

70-80-token prompts in 24-token chunked-prefill steps, a batch of five (two share a 48-token prefix
with the first) and the same batch again as prefix-cache hits, with block sizes 4 and 16. The free
block count after every step of a lone request is the rule's exact number; at the end every block is
free and the manager's integrity check passes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.parity.test_gemma_vs_hf import _COMMON
from tests.parity.test_models_vs_hf import _prompt, hf_greedy

WINDOW = 16
NUM_NEW = 8


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> tuple[Path, object]:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.MistralConfig(**{**_COMMON, "sliding_window": WINDOW}, num_hidden_layers=2, tie_word_embeddings=False)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if name.endswith("norm.weight") else p.normal_(0.0, 0.15)
    out = tmp_path_factory.mktemp("tiny-mistral-w16")
    model.save_pretrained(out)
    return out, model.eval()


def _engine(model_dir: Path, block_size: int, num_blocks: int):  # noqa: ANN202 - an EngineCore
    from tandem.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from tandem.engine.core import EngineCore

    config = EngineConfig(model=ModelConfig(model=str(model_dir), dtype="float32"),
                          cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=True),
                          scheduler=SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8), num_threads=1)
    return EngineCore(model_dir, config, progress=False)


def _run(core, prompts: list[list[int]], tag: str) -> tuple[list, list[int]]:  # noqa: ANN001
    """Runs ``prompts`` together to the end; returns their requests and the free block count after each step."""
    from tandem import SamplingParams
    from tandem.request import Request

    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    requests = [Request(f"{tag}{i}", list(p), params, max_tokens=NUM_NEW) for i, p in enumerate(prompts)]
    for request in requests:
        core.add_request(request)
    free = []
    while core.has_unfinished_requests():
        core.step()
        core.scheduler.check()
        free.append(core.scheduler.kv_cache_manager.num_free_blocks)
    return requests, free


def _expected_free(num_blocks: int, block_size: int, prompt_len: int) -> list[int]:
    """A lone request's free blocks after each step: it holds blocks ``(c - 15) // B .. (c + n - 1) // B``
    for a step computing n tokens from token c (24-token chunks, then decode), none once finished."""
    steps, c = [], 0
    while c < prompt_len + NUM_NEW - 1:
        n = min(24, prompt_len - c) if c < prompt_len else 1
        steps.append(num_blocks - (-(-(c + n) // block_size) - max(0, c - WINDOW + 1) // block_size))
        c += n
    return steps[:-1] + [num_blocks]


@pytest.mark.parametrize(("block_size", "num_blocks"), [(4, 160), (16, 40)])
def test_freed_window_blocks_keep_tokens_identical_to_transformers(mistral, block_size: int, num_blocks: int) -> None:
    model_dir, hf_model = mistral
    base = _prompt(48, seed=3)
    prompts = [base + _prompt(22, seed=4), _prompt(80, seed=5), base + _prompt(30, seed=6), _prompt(64, seed=7),
               base + _prompt(16, seed=8)]
    expected = [hf_greedy(hf_model, p, NUM_NEW) for p in prompts]
    core = _engine(model_dir, block_size, num_blocks)

    (alone,), free = _run(core, [prompts[1]], "alone")
    assert alone.output_token_ids == expected[1]
    assert free == _expected_free(num_blocks, block_size, 80)
    if block_size == 16:  # the numbers spelled out: prefill 0-24, 24-48, 48-72, 72-80, then decode
        assert free == [38, 37, 37, 38, 38, 38, 38, 38, 38, 38, 40]
    assert min(free) > num_blocks - -(-(80 + NUM_NEW) // block_size)  # never held the whole sequence

    for tag in ("first", "again"):  # the second pass hits the first one's blocks in the prefix cache
        requests, free = _run(core, prompts, tag)
        assert [r.output_token_ids for r in requests] == expected, (tag, block_size)
        assert free[-1] == num_blocks
    assert min(r.num_cached_tokens for r in requests) >= 48 // block_size * block_size
    kv = core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == num_blocks and not kv.request_ids
    kv.check()
