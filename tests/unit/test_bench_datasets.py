"""`tandem bench` datasets: random prompts of exact token length, JSONL and ShareGPT files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tandem.bench.datasets import (
    get_requests,
    jsonl_requests,
    load_tokenizer,
    random_requests,
    sample_lengths,
    sharegpt_requests,
    workload_settings,
)

CORPUS = [
    "Once upon a time there was a little girl called Lily who liked to play in the park.",
    "The quick brown fox jumps over the lazy dog; 12345 numbers, punctuation!? and CAPITALS.",
    "Tokenizers merge frequent byte pairs: calls, called, caller, here, there, where, ÜBER café.",
] * 20


@pytest.fixture(scope="module")
def gpt2_like_tokenizer():
    """A byte-level BPE (GPT-2 style, no BOS) trained in the test."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def stories_tokenizer(stories_dir):
    """The real stories260K tokenizer (SentencePiece-style BPE with byte fallback; adds BOS)."""
    return load_tokenizer(str(stories_dir))


@pytest.mark.parametrize("tokenizer_name", ["gpt2_like_tokenizer", "stories_tokenizer"])
@pytest.mark.parametrize("input_len,range_ratio", [(1, 0.0), (2, 0.0), (37, 0.0), (200, 0.0), (64, 0.5)])
def test_random_prompts_have_exactly_the_requested_token_count(
    request, tokenizer_name, input_len, range_ratio
):
    tok = request.getfixturevalue(tokenizer_name)
    if input_len == 1 and tokenizer_name == "stories_tokenizer":
        with pytest.raises(ValueError, match="no room"):  # BOS alone is already one token
            random_requests(tok, 2, input_len, 8, range_ratio, seed=0)
        return
    reqs = random_requests(tok, 20, input_len, 8, range_ratio, seed=3)
    assert len(reqs) == 20
    for r in reqs:
        # Re-tokenize the text as a completions server would (special tokens included).
        assert len(tok(r.prompt).input_ids) == r.prompt_len
    lens = [r.prompt_len for r in reqs]
    if range_ratio == 0.0:
        assert lens == [input_len] * 20
        assert all(r.expected_output_len == 8 for r in reqs)
    else:
        assert min(lens) >= 32 and max(lens) <= 96 and len(set(lens)) > 3
    # Same seed, same prompts; another seed, other prompts.
    assert [r.prompt for r in random_requests(tok, 20, input_len, 8, range_ratio, seed=3)] == [
        r.prompt for r in reqs
    ]
    if input_len > 2:
        assert random_requests(tok, 1, input_len, 8, range_ratio, seed=4)[0].prompt != reqs[0].prompt


def test_random_dataset_needs_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        get_requests(
            "random", num_prompts=1, input_len=8, output_len=4, range_ratio=0, seed=0, tokenizer=None
        )


def test_output_len_zero_is_rejected_not_replaced_by_the_default(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi"}\n')
    for dataset in ("random", "jsonl"):
        with pytest.raises(ValueError, match="--output-len must be >= 1, got 0"):
            get_requests(dataset, num_prompts=1, input_len=8, output_len=0, range_ratio=0, seed=0,
                         tokenizer=None, dataset_path=str(path))
    reqs = get_requests("jsonl", num_prompts=1, input_len=8, output_len=None, range_ratio=0, seed=0,
                        tokenizer=None, dataset_path=str(path))
    assert reqs[0].expected_output_len == 128
    assert workload_settings("jsonl", 8, None, 0.0, str(path)) == {
        "dataset": "jsonl", "dataset_path": str(path), "input_len": None, "output_len": 128, "range_ratio": None}
    assert workload_settings("sharegpt", 8, None, 0.0, "s.json")["output_len"] is None  # each reply's length


def test_sample_lengths_bounds():
    rng = np.random.default_rng(0)
    lens = sample_lengths(10, 0.25, 2000, rng)
    assert min(lens) == 7 and max(lens) == 13  # floor(7.5) .. ceil(12.5)
    assert sample_lengths(5, 0.0, 3, rng) == [5, 5, 5]
    with pytest.raises(ValueError):
        sample_lengths(5, 1.0, 3, rng)


def test_jsonl(tmp_path, gpt2_like_tokenizer):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello there"}\n\n{"prompt": "the fox", "output_len": 7}\n')
    reqs = jsonl_requests(str(path), 3, 16, gpt2_like_tokenizer, seed=0)
    assert [r.prompt for r in reqs] == ["hello there", "the fox", "hello there"]
    assert [r.expected_output_len for r in reqs] == [16, 7, 16]
    assert reqs[1].prompt_len == len(gpt2_like_tokenizer("the fox").input_ids)
    assert jsonl_requests(str(path), 1, 16, None, seed=0)[0].prompt_len is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match="prompt"):
        jsonl_requests(str(bad), 1, 16, None, seed=0)


def test_sharegpt(tmp_path, gpt2_like_tokenizer):
    convs = [
        {"conversations": [{"from": "human", "value": CORPUS[i % 3]},
                           {"from": "gpt", "value": CORPUS[(i + 1) % 3]}]}
        for i in range(6)
    ]
    convs.append({"conversations": [{"from": "human", "value": "one turn only"}]})
    convs.append({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": CORPUS[0]}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    reqs = sharegpt_requests(str(path), 10, None, gpt2_like_tokenizer, seed=1)
    assert len(reqs) == 6  # the one-turn and the 1-token-prompt conversations are dropped
    for r in reqs:
        assert r.prompt in CORPUS
        assert r.prompt_len == len(gpt2_like_tokenizer(r.prompt).input_ids)
        reply = CORPUS[(CORPUS.index(r.prompt) + 1) % 3]
        assert r.expected_output_len == len(gpt2_like_tokenizer(reply).input_ids)
    fixed = sharegpt_requests(str(path), 2, 5, None, seed=1)
    assert [r.expected_output_len for r in fixed] == [5, 5]
    with pytest.raises(ValueError, match="--output-len"):
        sharegpt_requests(str(path), 2, None, None, seed=1)
