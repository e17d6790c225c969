"""A live `tandem serve` on stories260K (float32), driven by the official `openai` client and httpx.

Greedy answers are checked against the transformers golden continuations shipped with the model.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from live_server import API_KEY, AUTH, CHATML, MODEL, sse_data


@pytest.fixture(scope="module")
def server(api_server):
    return api_server


@pytest.fixture(scope="module")
def client(api_client):
    return api_client


@pytest.fixture(scope="module")
def tokenizer(stories_tokenizer):
    return stories_tokenizer


@pytest.fixture(scope="module")
def golden(golden_cases):
    return golden_cases


def _in_context_text(tokenizer, case):
    """The golden output's text after its prompt, as vLLM returns it; golden.json's greedy_text is the
    output decoded alone, which drops a SentencePiece first-word space ("sang" + "▁and" -> "and")."""
    prompt_text = tokenizer.decode(case["prompt_token_ids"], skip_special_tokens=True)
    full = tokenizer.decode(case["prompt_token_ids"] + case["greedy_token_ids"], skip_special_tokens=True)
    assert full[len(prompt_text) :].removeprefix(" ") == case["greedy_text"]
    return full[len(prompt_text) :]


# ---- completions ----
def test_completion_greedy_matches_transformers(client, golden, tokenizer):
    for prompt, case in golden.items():
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=64, temperature=0)
        assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == MODEL
        assert out.choices[0].text == _in_context_text(tokenizer, case)
        assert out.choices[0].index == 0 and out.choices[0].finish_reason == "length"
        assert out.usage.prompt_tokens == len(case["prompt_token_ids"])
        assert out.usage.completion_tokens == 64
        assert out.usage.total_tokens == 64 + len(case["prompt_token_ids"])
        by_ids = client.completions.create(model=MODEL, prompt=case["prompt_token_ids"], max_tokens=64,
                                           temperature=0)
        assert by_ids.choices[0].text == _in_context_text(tokenizer, case)


def test_completion_list_prompt_and_echo(client, golden):
    prompts = list(golden)[:2]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=64, temperature=0, echo=True)
    assert [c.index for c in out.choices] == [0, 1]
    for choice, prompt in zip(out.choices, prompts, strict=True):
        assert choice.text == prompt + golden[prompt]["greedy_text"]
    assert out.usage.prompt_tokens == sum(len(golden[p]["prompt_token_ids"]) for p in prompts)
    assert out.usage.completion_tokens == 128


def test_completion_logprobs_shape(client):
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    # Each sampled token's text is what it added to the completion, SentencePiece spaces included.
    assert "".join(lp.tokens) == out.choices[0].text
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert lp.text_offset == offsets
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and value < 0
        assert max(top.values()) == pytest.approx(value)  # greedy: the sampled token is the top one
        assert top[token] == pytest.approx(value)


def test_n_with_seed_differs_and_reproduces(client):
    kwargs = dict(model=MODEL, prompt="Tom and his dog", max_tokens=16, temperature=1.0, n=2, seed=123)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1]
    assert texts[0] != texts[1]
    assert texts == [c.text for c in sorted(second.choices, key=lambda c: c.index)]
    assert first.usage.prompt_tokens == 7  # the prompt counts once, as in OpenAI


def test_stop_string_cut_in_stream_and_not(client, golden):
    full = golden["Once upon a time"]["greedy_text"]
    expected = full[: full.index("Lily")]
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=64, temperature=0,
                                    stop=["Lily"])
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=64,
                                            temperature=0, stop=["Lily"], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_usage_equals_tokenizer_counts_and_default_max_tokens(client, tokenizer):
    prompt = "The little cat sat on the mat"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=9, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
    assert out.usage.completion_tokens == 9
    # max_tokens null: generate up to the context limit (512), as vLLM does.
    ids = [1] + [400] * 499
    out = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=None,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 12 and out.choices[0].finish_reason == "length"
    # max_tokens absent: 16, checked against the context like a given value (OpenAI's and vLLM's 400).
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=ids, temperature=0, extra_body={"ignore_eos": True})
    assert e.value.status_code == 400 and e.value.body["param"] == "prompt"
    assert "516 tokens (500 in the prompt, 16 in the completion)" in e.value.body["message"]


def test_completion_max_tokens_default_is_16(client, golden, tokenizer):
    """Absent max_tokens: 16 tokens (the legacy OpenAI API's and vLLM's default), the golden greedy ones."""
    case = golden["Once upon a time"]
    assert len(case["greedy_token_ids"]) > 16 and tokenizer.eos_token_id not in case["greedy_token_ids"][:16]
    out = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0)
    prompt_text = tokenizer.decode(case["prompt_token_ids"], skip_special_tokens=True)
    full = tokenizer.decode(case["prompt_token_ids"] + case["greedy_token_ids"][:16], skip_special_tokens=True)
    assert out.choices[0].text == full[len(prompt_text):]
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-2].choices[0].finish_reason == "length"
    # Chat keeps its default: up to the context limit (512 tokens).
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 512 - chat.usage.prompt_tokens
    assert chat.choices[0].finish_reason == "length"


# ---- chat ----
def _rendered_ids(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, chat_template=CHATML, tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_chat_uses_template_and_counts(client, tokenizer):
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Tell one."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20,
                                         temperature=0)
    ids = _rendered_ids(tokenizer, messages)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(ids)
    # The same token ids through /v1/completions give the same greedy text.
    same = client.completions.create(model=MODEL, prompt=ids, max_tokens=20, temperature=0)
    assert out.choices[0].message.content == same.choices[0].text
    assert out.usage.completion_tokens == same.usage.completion_tokens


def test_chat_text_parts_and_max_completion_tokens(client):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    a = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}],
                                       max_tokens=30, max_completion_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    b = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello\nthere"}],
                                       max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert a.usage.completion_tokens == 4 and a.choices[0].finish_reason == "length"
    assert a.choices[0].message.content == b.choices[0].message.content


def test_chat_logprobs_shape(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    text = out.choices[0].message.content
    assert "".join(t.token for t in content) == text
    for entry in content:
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_chat_n_seed(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Go"}], max_tokens=12, temperature=1.0,
                  n=2, seed=5)
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1] and texts[0] != texts[1]
    assert texts == [c.message.content for c in b.choices]


# ---- streaming ----
def test_completion_stream_equals_non_stream(server, golden):
    body = {"model": MODEL, "prompt": "Tom and his dog", "max_tokens": 64, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = sse_data(r)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 7, "completion_tokens": 64,
                                                         "total_tokens": 71,
                                                         "prompt_tokens_details": {"cached_tokens": 0}}
    assert all(c["usage"] is None and c["object"] == "text_completion" for c in chunks[:-1])
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == golden["Tom and his dog"]["greedy_text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_chat_stream_equals_non_stream(server, client):
    messages = [{"role": "user", "content": "Tell me a story"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    body = {"model": MODEL, "messages": messages, "max_tokens": 40, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
        data = sse_data(r)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == full.choices[0].message.content
    assert chunks[-2]["choices"][0]["finish_reason"] == full.choices[0].finish_reason
    # The same prompt again: its full blocks (16 tokens each) come from the prefix cache this time.
    usage = {**full.usage.model_dump(exclude_none=True),
             "prompt_tokens_details": {"cached_tokens": (full.usage.prompt_tokens - 1) // 16 * 16}}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage


def test_stream_without_usage_has_no_usage_field(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=5, temperature=0, stream=True, n=2, seed=1))
    assert all(c.usage is None for c in chunks)
    assert sorted({c.choices[0].index for c in chunks}) == [0, 1]
    finished = [c.choices[0] for c in chunks if c.choices[0].finish_reason is not None]
    assert sorted(ch.index for ch in finished) == [0, 1]


def test_32_concurrent_equal_sequential(server):
    prompts = [f"{name} went to the {place}" for name in ("Tom", "Lily", "Sam", "Max")
               for place in ("park", "shop", "sea", "zoo", "farm", "lake", "hill", "town")]

    async def run(concurrent: bool) -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as c:
            async def one(p):
                r = await c.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0)
                return r.choices[0].text
            if concurrent:
                return list(await asyncio.gather(*(one(p) for p in prompts)))
            return [await one(p) for p in prompts]

    assert asyncio.run(run(True)) == asyncio.run(run(False))
