"""Benchmark prompts: random prompts of exact token length, JSONL and ShareGPT files.

Lengths follow `vllm bench serve`: a random prompt of `input_len` tokens is one whose tokenization
by the target model's tokenizer, special tokens included (the BOS a completions server adds), is
exactly `input_len` tokens long; `--range-ratio r` draws each length uniformly from the integers in
[floor(L * (1 - r)), ceil(L * (1 + r))].
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_OUTPUT_LEN = 128  # max_tokens of random/jsonl requests without --output-len (as vLLM)
# NOTE: decode -> re-encode rarely needs more than two rounds; the cap turns a tokenizer that
# cannot round-trip into a clear error instead of an endless loop.
_MAX_FIT_ROUNDS = 32


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request.

    prompt: the text sent as `prompt` (completions) or as the user message (chat).
    prompt_len: prompt length in tokens as the target tokenizer counts it, or None when no
        tokenizer was given (the server's `usage.prompt_tokens` fills it in later).
    expected_output_len: `max_tokens` for this request.
    """

    prompt: str
    prompt_len: int | None
    expected_output_len: int


def load_tokenizer(path: str | None) -> Any | None:
    """Load a Hugging Face tokenizer from a local folder or a `.gguf` file.

    Returns None when `path` is None. Raises OSError/ValueError from transformers when the path
    holds no tokenizer.
    """
    if path is None:
        return None
    from transformers import AutoTokenizer

    if path.endswith(".gguf") and os.path.isfile(path):
        folder, name = os.path.split(os.path.abspath(path))
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return AutoTokenizer.from_pretrained(path)


def default_tokenizer_path(tokenizer: str | None, model: str | None) -> str | None:
    """`--tokenizer` if given, else `--model` when it names a local path, else None."""
    if tokenizer:
        return tokenizer
    if model and os.path.exists(model):
        return model
    return None


def sample_lengths(mean: int, range_ratio: float, n: int, rng: np.random.Generator) -> list[int]:
    """Draw n integer lengths uniformly from [floor(mean*(1-r)), ceil(mean*(1+r))], at least 1.

    Raises ValueError when range_ratio is outside [0, 1) or mean < 1.
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if mean < 1:
        raise ValueError(f"length must be >= 1, got {mean}")
    low = max(1, math.floor(mean * (1.0 - range_ratio)))
    high = max(low, math.ceil(mean * (1.0 + range_ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def _token_pool(tokenizer: Any) -> np.ndarray:
    """Ids that decode alone to printable text: no special tokens, byte pieces or control chars."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(tokenizer.vocab_size) if i not in special]
    texts = tokenizer.batch_decode([[i] for i in ids])
    pool = [i for i, t in zip(ids, texts, strict=True) if t.strip() and t.isprintable() and "\ufffd" not in t]
    if not pool:
        raise ValueError("tokenizer has no ordinary tokens to build random prompts from")
    return np.array(pool)


def fit_prompt(
    tokenizer: Any, token_ids: list[int], target: int, pool: np.ndarray, rng: np.random.Generator
) -> str:
    """Return a text whose tokenization (special tokens included) is exactly `target` tokens.

    Decodes `token_ids`, re-encodes, and truncates or pads with random pool tokens until the
    re-tokenized length matches; a decode/encode pair can merge or split tokens, hence the loop.
    Raises ValueError when no exact fit is found within a bounded number of rounds.
    """
    num_special = len(tokenizer("").input_ids)
    content = target - num_special
    if content < 1:
        raise ValueError(f"input length {target} leaves no room after {num_special} special tokens")
    ids = list(token_ids)
    for _ in range(_MAX_FIT_ROUNDS):
        ids = ids[:content] + rng.choice(pool, max(0, content - len(ids))).tolist()
        text = tokenizer.decode(ids)
        n = len(tokenizer(text).input_ids)
        if n == target:
            return text
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if n < target and len(ids) >= content:
            # NOTE: the text re-encodes with fewer special tokens than `tokenizer("")` suggested
            # (e.g. an added-space merge); drop one and let padding refill.
            ids = ids[:-1]
    raise ValueError(f"could not build a prompt of exactly {target} tokens")


def _fit_with_retries(tokenizer: Any, target: int, pool: np.ndarray, rng: np.random.Generator) -> str:
    """fit_prompt from fresh random tokens, up to three draws (a draw can merge unluckily)."""
    for attempt in range(3):
        try:
            return fit_prompt(tokenizer, rng.choice(pool, target).tolist(), target, pool, rng)
        except ValueError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def random_requests(
    tokenizer: Any, num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[SampleRequest]:
    """Random-token prompts of exact length for `tokenizer`, reproducible from `seed`.

    Raises ValueError for bad lengths, range ratio, or a tokenizer that cannot fit the length.
    """
    if tokenizer is None:
        raise ValueError("the random dataset needs a tokenizer: pass --tokenizer PATH")
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(input_len, range_ratio, num_prompts, rng)
    out_lens = sample_lengths(output_len, range_ratio, num_prompts, rng)
    pool = _token_pool(tokenizer)
    requests = []
    for n_in, n_out in zip(in_lens, out_lens, strict=True):
        text = _fit_with_retries(tokenizer, n_in, pool, rng)
        requests.append(SampleRequest(prompt=text, prompt_len=n_in, expected_output_len=n_out))
    return requests


def _count(tokenizer: Any | None, text: str) -> int | None:
    return None if tokenizer is None else len(tokenizer(text).input_ids)


def jsonl_requests(
    path: str, num_prompts: int, output_len: int, tokenizer: Any | None, seed: int
) -> list[SampleRequest]:
    """Requests from a JSON-lines file: one object per line with `prompt` (str) and an optional
    `output_len` or `max_tokens` (int; default `output_len`). The first `num_prompts` lines are
    used in file order (cycled when the file is shorter; `seed` is unused, kept for symmetry).

    Raises ValueError on a line without a string `prompt` or an empty file.
    """
    del seed
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{lineno}: each line needs a string 'prompt'")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    out = []
    for i in range(num_prompts):
        row = rows[i % len(rows)]
        n_out = int(row.get("output_len", row.get("max_tokens", output_len)))
        out.append(SampleRequest(row["prompt"], _count(tokenizer, row["prompt"]), n_out))
    return out


def sharegpt_requests(
    path: str, num_prompts: int, output_len: int | None, tokenizer: Any | None, seed: int
) -> list[SampleRequest]:
    """Requests from a ShareGPT JSON file (a list of {"conversations": [{"value": ...}, ...]}).

    As in `vllm bench serve`: conversations with fewer than two turns are dropped, the list is
    shuffled with `seed`, the first turn is the prompt and the second turn's token count is the
    output length unless `output_len` is given; pairs with prompt or output under 4 tokens, a
    prompt over 1024 or a sum over 2048 tokens are skipped (only when lengths are known).
    Raises ValueError when neither a tokenizer nor output_len is given, or nothing qualifies.
    """
    if tokenizer is None and output_len is None:
        raise ValueError("sharegpt needs --tokenizer or --output-len to set output lengths")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    convs = [d.get("conversations", d.get("conversation", [])) for d in data]
    convs = [c for c in convs if len(c) >= 2]
    random.Random(seed).shuffle(convs)
    out: list[SampleRequest] = []
    for conv in convs:
        if len(out) == num_prompts:
            break
        prompt, completion = conv[0]["value"], conv[1]["value"]
        p_len = _count(tokenizer, prompt)
        o_len = output_len if output_len is not None else _count(tokenizer, completion)
        if p_len is not None and (p_len < 4 or p_len > 1024 or p_len + o_len > 2048):
            continue
        if o_len < 4 and output_len is None:
            continue
        out.append(SampleRequest(prompt, p_len, o_len))
    if not out:
        raise ValueError(f"{path}: no conversation passed the ShareGPT length filters")
    return out


def get_requests(
    dataset: str,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int | None,
    range_ratio: float,
    seed: int,
    tokenizer: Any | None,
    dataset_path: str | None = None,
) -> list[SampleRequest]:
    """Dispatch on the dataset name (`random`, `jsonl`, `sharegpt`).

    output_len None means the dataset default (128 for random/jsonl, the reply's length for
    sharegpt). Raises ValueError for an unknown name, a missing `dataset_path`, or an
    output_len / num_prompts below 1.
    """
    if output_len is not None and output_len < 1:
        raise ValueError(f"--output-len must be >= 1, got {output_len}")
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if dataset == "random":
        n_out = DEFAULT_OUTPUT_LEN if output_len is None else output_len
        return random_requests(tokenizer, num_prompts, input_len, n_out, range_ratio, seed)
    if dataset not in ("jsonl", "sharegpt"):
        raise ValueError(f"unknown dataset {dataset!r}; choose random, jsonl or sharegpt")
    if not dataset_path:
        raise ValueError(f"--dataset {dataset} needs --dataset-path")
    if dataset == "jsonl":
        n_out = DEFAULT_OUTPUT_LEN if output_len is None else output_len
        return jsonl_requests(dataset_path, num_prompts, n_out, tokenizer, seed)
    return sharegpt_requests(dataset_path, num_prompts, output_len, tokenizer, seed)


def workload_settings(
    dataset: str, input_len: int, output_len: int | None, range_ratio: float, dataset_path: str | None
) -> dict[str, Any]:
    """What a saved result records about its prompts, for `tandem bench compare` to check that two
    runs sent the same load: `dataset`, `dataset_path`, `input_len` (random only, else None),
    `output_len` (the max_tokens default in effect; None = each ShareGPT reply's length) and
    `range_ratio` (random only)."""
    random_set = dataset == "random"
    if output_len is None and dataset != "sharegpt":
        output_len = DEFAULT_OUTPUT_LEN
    return {
        "dataset": dataset,
        "dataset_path": None if random_set else dataset_path,
        "input_len": input_len if random_set else None,
        "output_len": output_len,
        "range_ratio": range_ratio if random_set else None,
    }
