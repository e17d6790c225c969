"""Parity of Tandem's paged forward pass with transformers, on tiny random checkpoints and stories260K.

Logit error is measured as ``max |ours - hf| / max |hf|`` over all positions and vocabulary entries.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.config import CacheConfig, EngineConfig, ModelConfig
from tandem.outputs import NewRequestData, ScheduledRequest, SchedulerOutput
from tandem.sampling_params import SamplingParams
from tandem.worker.model_runner import ModelRunner

REL_TOL = 1e-4
TINY_MODELS = ("llama", "llama3_rope", "mistral", "qwen2", "qwen3")  # as in conftest.py
TINY_VOCAB = 128
NUM_NEW = 32


def make_runner(model_dir: Path, block_size: int = 4, num_blocks: int = 64, backend=None,  # noqa: ANN001
                dtype: str = "float32") -> ModelRunner:
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype=dtype),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        num_threads=1,
    )
    runner = ModelRunner(model_dir, config, progress=False, backend=backend)
    runner.initialize_kv_cache(num_blocks)
    return runner


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def run_greedy(
    runner: ModelRunner, prompts: list[list[int]], num_new: int, chunk: int = 1 << 30, stagger: int = 0
) -> list[list[int]]:
    """Greedy-decode ``prompts`` together through ``runner.execute``, a tiny scheduler of our own.

    Each step, every active request runs up to ``chunk`` of its uncomputed tokens (prefill chunks,
    then one token per decode step) and samples when it reaches its last token. Request i joins at
    step ``i * stagger``, so prefills share steps with other requests' decodes. Block tables come
    from a shuffled free list, so no request's blocks are contiguous.
    """
    bs = runner.block_size
    free = torch.randperm(runner.num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    ids = [f"req-{i}" for i in range(len(prompts))]
    tables: list[list[int]] = [[] for _ in prompts]
    computed = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=num_new)
    step = 0
    while any(len(o) < num_new for o in outputs):
        new, scheduled = [], []
        for i, prompt in enumerate(prompts):
            if step < i * stagger or len(outputs[i]) >= num_new:
                continue
            if step == i * stagger:
                new.append(NewRequestData(ids[i], prompt, [], params))
            tokens = prompt + outputs[i]
            todo = tokens[computed[i] : computed[i] + chunk]
            while len(tables[i]) * bs < computed[i] + len(todo):
                tables[i].append(free.pop())
            sample = computed[i] + len(todo) == len(tokens)
            scheduled.append(ScheduledRequest(ids[i], todo, computed[i], list(tables[i]), sample))
            computed[i] += len(todo)
        out = runner.execute(SchedulerOutput(scheduled=scheduled, new_requests=new))
        for i, rid in enumerate(ids):
            outputs[i] += out.sampled_token_ids.get(rid, [])
        step += 1
    runner.execute(SchedulerOutput(finished_request_ids=set(ids)))
    return outputs


def hf_greedy(hf_model, prompt: list[int], num_new: int) -> list[int]:
    """transformers' greedy continuation, never stopping at EOS."""
    hf_model.generation_config.eos_token_id = None
    out = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=num_new, do_sample=False, pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def tiny_pair(tiny_model_name, tiny_checkpoint_factory):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_checkpoint_factory(tiny_model_name)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tiny_model_name, hf_model, make_runner(model_dir)


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, TINY_VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prompt_logits_match_transformers(tiny_pair) -> None:
    name, hf_model, runner = tiny_pair
    prompt = _prompt(45, seed=1)  # beyond original_max_position_embeddings=32 of the llama3 case
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0].float()
    ours = runner.prompt_logits(prompt)
    assert ours.dtype == torch.float32 and ours.shape == (len(prompt), TINY_VOCAB)
    assert rel_err(ours, ref) < REL_TOL, name


def test_chunked_prefill_matches_transformers(tiny_pair) -> None:
    name, hf_model, runner = tiny_pair
    prompt = _prompt(20, seed=2)
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0].float()
    chunked = runner.prompt_logits(prompt, chunk_size=3)
    assert rel_err(chunked, ref) < REL_TOL, name
    assert rel_err(chunked, runner.prompt_logits(prompt)) < 1e-5, name


def test_greedy_decode_matches_generate(tiny_pair) -> None:
    name, hf_model, runner = tiny_pair
    prompts = [_prompt(7, seed=3), _prompt(13, seed=4), _prompt(1, seed=5)]
    expected = [hf_greedy(hf_model, p, NUM_NEW) for p in prompts]
    assert len(set(map(tuple, expected))) == 3  # the cases really differ
    for i, prompt in enumerate(prompts):  # one request at a time, whole prompt in one step
        assert run_greedy(runner, [prompt], NUM_NEW) == [expected[i]], (name, i)
    # Batched, staggered, with 3-token prefill chunks: rows mix prefill chunks and decodes.
    assert run_greedy(runner, prompts, NUM_NEW, chunk=3, stagger=2) == expected, name


def test_tiny_checkpoints_cover_their_cases(tiny_checkpoint_factory) -> None:
    """Guards the fixture: the cases really are sharded / tied / legacy-rope as the tests assume."""
    from tandem.models.hf_config import load_hf_config

    assert (tiny_checkpoint_factory("qwen3") / "model.safetensors.index.json").is_file()
    cfgs = {name: load_hf_config(tiny_checkpoint_factory(name)) for name in TINY_MODELS}
    assert cfgs["qwen3"].head_dim == 32 and cfgs["qwen3"].hidden_size // cfgs["qwen3"].num_heads == 16
    assert cfgs["llama3_rope"].rope.rope_type == "llama3" and cfgs["llama3_rope"].tie_word_embeddings
    assert cfgs["qwen2"].attention_bias and cfgs["qwen2"].tie_word_embeddings
    assert not cfgs["llama"].tie_word_embeddings
    assert cfgs["mistral"].architecture == "MistralForCausalLM"


def test_stories260k_golden_greedy(stories_dir: Path) -> None:
    golden = json.loads((stories_dir / "golden.json").read_text())
    runner = make_runner(stories_dir, block_size=16, num_blocks=32)
    for case in golden["cases"]:
        ours = run_greedy(runner, [case["prompt_token_ids"]], len(case["greedy_token_ids"]))
        assert ours == [case["greedy_token_ids"]], case["prompt"]
