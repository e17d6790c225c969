"""The router's reading of request bodies (``router/prompt.py``) with the real stories260K tokenizer."""

import json

import pytest

from tandem.kv_cache.hashing import hash_token_blocks
from tandem.router.prompt import MAX_ROUTED_CHARS, PromptReader

BS = 16
STORY = "Once upon a time there was a little girl named Lily. She loved to play in the park with her dog. "
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


class _Recording:
    """The tokenizer, remembering the longest text it was asked to tokenize."""

    def __init__(self, tokenizer):
        self.inner = tokenizer
        self.longest = 0

    def __call__(self, text, **kwargs):
        self.longest = max(self.longest, len(text))
        return self.inner(text, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        return self.inner.apply_chat_template(*args, **kwargs)


@pytest.fixture(scope="module")
def tokenizer(stories_dir):
    from tandem.bench.datasets import load_tokenizer

    return load_tokenizer(str(stories_dir))


def _read(reader, body, chat=False):
    return reader.read(json.dumps(body).encode(), chat)


def test_short_prompt_hashes_are_the_engines_keys(tokenizer):
    reader = PromptReader(tokenizer, BS)
    ids = tokenizer(STORY * 3)["input_ids"]
    p = _read(reader, {"prompt": STORY * 3, "max_tokens": 5, "n": 2})
    assert list(p.block_hashes) == hash_token_blocks(ids, BS)
    assert (p.num_prompt_tokens, p.num_tokens) == (len(ids), len(ids) + 10)


@pytest.mark.parametrize("chat", [False, True])
def test_huge_prompt_is_routed_on_its_start(tokenizer, chat):
    """A prompt of megabytes is tokenized only up to MAX_ROUTED_CHARS (it took the router's threads tens
    of seconds while the backend rejected it at once); the hashes are the full prompt's leading ones."""
    text = STORY * (MAX_ROUTED_CHARS // len(STORY) + 400)  # about 40,000 characters over the cap
    rec = _Recording(tokenizer)
    reader = PromptReader(rec, BS, TEMPLATE)
    if chat:
        body = {"messages": [{"role": "user", "content": text}]}
        full_text = tokenizer.apply_chat_template(body["messages"], chat_template=TEMPLATE, tokenize=False,
                                                  add_generation_prompt=True)
        full = tokenizer(full_text, add_special_tokens=False)["input_ids"]
    else:
        body = {"prompt": text}
        full = tokenizer(text)["input_ids"]
    p = _read(reader, body, chat)
    assert rec.longest <= MAX_ROUTED_CHARS
    want = hash_token_blocks(full, BS)
    n = len(p.block_hashes)
    assert list(p.block_hashes) == want[:n]
    assert len(want) * 0.8 < n < len(want)  # the cut drops the blocks past the cap, and one at it
    assert abs(p.num_prompt_tokens - len(full)) < 0.1 * len(full)
