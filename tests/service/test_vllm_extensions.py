"""vLLM's extensions of the OpenAI API on a live `tandem serve` (stories260K), driven by the official
`openai` client: ``return_tokens_as_token_ids`` (request) and ``stop_reason`` (each choice).

Token ids are checked against the transformers golden continuation shipped with the model and against
its tokenizer (the ids decode, in context, to the returned text)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from live_server import AUTH, CHATML, MODEL, Server

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def case(golden_cases):
    """The golden greedy continuation of PROMPT: ``prompt_token_ids``, ``greedy_token_ids``."""
    return golden_cases[PROMPT]


def ids_of(tokens: list[str]) -> list[int]:
    """The ids of ``token_id:{id}`` strings (anything else fails the test)."""
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


def in_context(tokenizer, prompt_ids: list[int], ids: list[int]) -> str:
    """The text ``ids`` add after ``prompt_ids`` (as the server detokenizes it)."""
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    return tokenizer.decode(prompt_ids + ids, skip_special_tokens=True)[len(prompt_text):]


# ---- return_tokens_as_token_ids ----
def test_completion_tokens_as_token_ids(api_client, case, stories_tokenizer):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    plain = api_client.completions.create(**kwargs).choices[0]
    out = api_client.completions.create(**kwargs, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    expected = case["greedy_token_ids"][:6]
    assert out.logprobs.tokens == [f"token_id:{i}" for i in expected]
    assert out.text == plain.text == in_context(stories_tokenizer, case["prompt_token_ids"], expected)
    # Offsets still index the text; values are those of the plain request, rank by rank.
    assert out.logprobs.text_offset == plain.logprobs.text_offset
    assert out.logprobs.token_logprobs == plain.logprobs.token_logprobs
    for token_id, top, plain_top in zip(expected, out.logprobs.top_logprobs, plain.logprobs.top_logprobs,
                                        strict=True):
        assert ids_of(list(top))[0] == token_id  # greedy: the chosen token ranks first
        assert len(set(ids_of(list(top)))) == 2 and list(top.values()) == list(plain_top.values())


def test_completion_echo_tokens_as_token_ids(api_client, case):
    out = api_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1,
                                        echo=True, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    assert out.logprobs.tokens == [f"token_id:{i}" for i in case["prompt_token_ids"] + case["greedy_token_ids"][:3]]
    assert out.logprobs.top_logprobs[0] is None and out.logprobs.token_logprobs[0] is None  # BOS: nothing before it
    prompt_ids = case["prompt_token_ids"]
    for token_id, top in zip(prompt_ids[1:], out.logprobs.top_logprobs[1:len(prompt_ids)], strict=True):
        top_ids = ids_of(list(top))  # the most likely token, then the prompt's own when it ranks lower
        assert top_ids in ([token_id], [top_ids[0], token_id]), (token_id, top)
    for token_id, top in zip(case["greedy_token_ids"][:3], out.logprobs.top_logprobs[len(prompt_ids):], strict=True):
        assert ids_of(list(top)) == [token_id]


def test_chat_tokens_as_token_ids_and_bytes(api_client, stories_tokenizer):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0,
                  logprobs=True, top_logprobs=2)
    plain = api_client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    out = api_client.chat.completions.create(**kwargs,
                                             extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    content, plain_content = out.choices[0].logprobs.content, plain.choices[0].logprobs.content
    ids = ids_of([entry.token for entry in content])
    assert len(ids) == 5 and out.choices[0].message.content == plain.choices[0].message.content
    prompt_ids = stories_tokenizer(stories_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], chat_template=CHATML, tokenize=False,
        add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    assert in_context(stories_tokenizer, prompt_ids, ids) == out.choices[0].message.content
    for token_id, entry, plain_entry in zip(ids, content, plain_content, strict=True):
        # vLLM's rendering: the sampled token's bytes are its text's, an alternative's those of "token_id:N".
        assert entry.bytes == plain_entry.bytes == list(plain_entry.token.encode("utf-8"))
        assert entry.logprob == plain_entry.logprob
        top_ids = ids_of([alt.token for alt in entry.top_logprobs])
        assert top_ids[0] == token_id and len(set(top_ids)) == 2
        assert [alt.bytes for alt in entry.top_logprobs] == [list(f"token_id:{t}".encode()) for t in top_ids]
        assert [alt.logprob for alt in entry.top_logprobs] == [alt.logprob for alt in plain_entry.top_logprobs]


def test_chat_stream_tokens_as_token_ids(api_client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0,
                  logprobs=True, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    full = api_client.chat.completions.create(**kwargs).choices[0].logprobs.content
    chunks = list(api_client.chat.completions.create(**kwargs, stream=True))
    streamed = [e.token for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(streamed) == 5 and ids_of(streamed) == ids_of([e.token for e in full])


# ---- stop_reason ----
def first_new(ids: list[int], start: int) -> int:
    """The first index from ``start`` on whose token does not occur before it (a stop token that ends there)."""
    return next(i for i in range(start, len(ids)) if ids[i] not in ids[:i])


def test_completion_stop_reason(api_client, case):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=64, temperature=0)
    out = api_client.completions.create(**kwargs, stop=["no such text", "Lily"]).choices[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", "Lily") and "Lily" not in out.text
    chunks = list(api_client.completions.create(**kwargs, stop=["Lily"], stream=True))
    assert [(c.choices[0].finish_reason, c.choices[0].stop_reason) for c in chunks[-2:]] == [
        (None, None), ("stop", "Lily")]
    ids = case["greedy_token_ids"]
    k = first_new(ids, 3)
    out = api_client.completions.create(**kwargs, extra_body={"stop_token_ids": [ids[k]]})
    assert (out.choices[0].finish_reason, out.choices[0].stop_reason) == ("stop", ids[k])
    assert out.usage.completion_tokens == k + 1
    # A stop token that is also the max_tokens-th token: "stop" with its id (vLLM checks it before the length).
    out = api_client.completions.create(**{**kwargs, "max_tokens": k + 1}, extra_body={"stop_token_ids": [ids[k]]})
    assert (out.choices[0].finish_reason, out.choices[0].stop_reason) == ("stop", ids[k])
    assert out.usage.completion_tokens == k + 1
    out = api_client.completions.create(**{**kwargs, "max_tokens": 5}).choices[0]
    assert (out.finish_reason, out.stop_reason) == ("length", None)
    chunks = list(api_client.completions.create(**{**kwargs, "max_tokens": 5}, stream=True))
    assert (chunks[-1].choices[0].finish_reason, chunks[-1].choices[0].stop_reason) == ("length", None)


def test_chat_stop_reason(api_client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=40,
                  temperature=0)
    plain = api_client.chat.completions.create(**kwargs, logprobs=True,
                                               extra_body={"return_tokens_as_token_ids": True}).choices[0]
    assert (plain.finish_reason, plain.stop_reason) == ("length", None)
    word = plain.message.content.split()[4]
    out = api_client.chat.completions.create(**kwargs, stop=[word]).choices[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", word)
    assert out.message.content == plain.message.content[:plain.message.content.index(word)]
    chunks = list(api_client.chat.completions.create(**kwargs, stop=[word], stream=True))
    assert (chunks[-1].choices[0].finish_reason, chunks[-1].choices[0].stop_reason) == ("stop", word)
    assert all(not hasattr(c.choices[0], "stop_reason") for c in chunks[:-1])  # as vLLM: on the last chunk only
    ids = ids_of([e.token for e in plain.logprobs.content])
    k = first_new(ids, 3)
    out = api_client.chat.completions.create(**kwargs, extra_body={"stop_token_ids": [ids[k]]})
    assert (out.choices[0].finish_reason, out.choices[0].stop_reason) == ("stop", ids[k])
    assert out.usage.completion_tokens == k + 1
    chunks = list(api_client.chat.completions.create(**kwargs, stream=True, extra_body={"stop_token_ids": [ids[k]]}))
    assert (chunks[-1].choices[0].finish_reason, chunks[-1].choices[0].stop_reason) == ("stop", ids[k])


@pytest.fixture(scope="module")
def eos_server(stories_dir, case, tmp_path_factory):
    """stories260K whose EOS is a token its greedy continuation of PROMPT reaches (greedy never reaches
    its own EOS), so a request can end on EOS. Yields (server, that EOS id, its index in the continuation)."""
    ids = case["greedy_token_ids"]
    k = first_new(ids, 3)
    model = tmp_path_factory.mktemp("eos-model")
    for f in stories_dir.iterdir():
        if f.name not in ("config.json", "generation_config.json"):
            (model / f.name).symlink_to(f)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((stories_dir / name).read_text())
        (model / name).write_text(json.dumps({**config, "eos_token_id": ids[k]}))
    server = Server(model, model.parent / "server.log")
    try:
        server.wait_healthy()
        yield server, ids[k], k
    finally:
        server.stop()


def test_eos_listed_in_stop_token_ids_has_null_stop_reason(eos_server):
    """vLLM checks EOS before stop_token_ids: ending on EOS gives stop_reason null even when the client
    lists EOS's id among its stop tokens; with ignore_eos, EOS is a stop token like any other."""
    server, eos, k = eos_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    kwargs = dict(model=server.model, prompt=PROMPT, max_tokens=64, temperature=0)
    plain = client.completions.create(**kwargs)
    assert (plain.choices[0].finish_reason, plain.choices[0].stop_reason) == ("stop", None)
    assert plain.usage.completion_tokens == k + 1
    for extra, stop_reason in [({"stop_token_ids": [eos]}, None), ({"stop_token_ids": [eos], "ignore_eos": True}, eos)]:
        out = client.completions.create(**kwargs, extra_body=extra)
        assert (out.choices[0].finish_reason, out.choices[0].stop_reason) == ("stop", stop_reason)
        assert out.choices[0].text == plain.choices[0].text and out.usage == plain.usage
        chunks = list(client.completions.create(**kwargs, extra_body=extra, stream=True))
        assert (chunks[-1].choices[0].finish_reason, chunks[-1].choices[0].stop_reason) == ("stop", stop_reason)


# ---- truncate_prompt_tokens ----
def test_completion_truncate_prompt_tokens_keeps_the_last_ids(api_client, case):
    """vLLM's truncate_prompt_tokens: the last k prompt tokens are the prompt (usage counts them), so the
    answer is that of the token-id prompt of those k ids; -1 keeps up to the context length."""
    prompt_ids = case["prompt_token_ids"]
    kwargs = dict(model=MODEL, max_tokens=8, temperature=0)
    cut = api_client.completions.create(**kwargs, prompt=PROMPT, extra_body={"truncate_prompt_tokens": 3})
    same = api_client.completions.create(**kwargs, prompt=prompt_ids[-3:])
    assert cut.usage.prompt_tokens == same.usage.prompt_tokens == 3
    assert cut.choices[0].text == same.choices[0].text
    echoed = api_client.completions.create(**kwargs, prompt=prompt_ids, echo=True,
                                           extra_body={"truncate_prompt_tokens": 3})
    assert echoed.choices[0].text == api_client.completions.create(**kwargs, prompt=prompt_ids[-3:],
                                                                   echo=True).choices[0].text
    whole = api_client.completions.create(**kwargs, prompt=PROMPT, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(prompt_ids)
    # A prompt longer than the context (512) fits once cut.
    long_ids = (prompt_ids * 200)[:600]
    out = api_client.completions.create(**kwargs, prompt=long_ids, extra_body={"truncate_prompt_tokens": 500})
    assert out.usage.prompt_tokens == 500
    assert out.choices[0].text == api_client.completions.create(**kwargs, prompt=long_ids[-500:]).choices[0].text


def test_chat_truncate_prompt_tokens_keeps_the_last_ids(api_client, api_server):
    messages = [{"role": "user", "content": "Tell me a story about a cat"}]
    ids = httpx.post(f"{api_server.url}/tokenize", json={"model": MODEL, "messages": messages},
                     headers=AUTH, timeout=30).json()["tokens"]
    kwargs = dict(model=MODEL, max_tokens=8, temperature=0)
    cut = api_client.chat.completions.create(**kwargs, messages=messages, extra_body={"truncate_prompt_tokens": 4})
    same = api_client.completions.create(**kwargs, prompt=ids[-4:])
    assert cut.usage.prompt_tokens == 4
    assert cut.choices[0].message.content == same.choices[0].text
    chunks = list(api_client.chat.completions.create(**kwargs, messages=messages, stream=True,
                                                     stream_options={"include_usage": True},
                                                     extra_body={"truncate_prompt_tokens": 4}))
    assert chunks[-1].usage.prompt_tokens == 4
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == same.choices[0].text


@pytest.mark.parametrize("path, value, message", [
    ("/v1/completions", 0, "truncate_prompt_tokens must be -1 (the context length) or at least 1, got 0"),
    ("/v1/chat/completions", 513, "truncate_prompt_tokens value (513) is greater than max_model_len (512). "
                                  "Please, select a smaller truncation size."),
    ("/v1/completions", -2, "truncate_prompt_tokens: Input should be greater than or equal to -1"),
    ("/v1/completions", "3", "truncate_prompt_tokens: Input should be a valid integer"),
])
def test_bad_truncate_prompt_tokens_is_400(api_server, path, value, message):
    base = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    r = httpx.post(f"{api_server.url}{path}", json={"model": MODEL, **base, "max_tokens": 2,
                                                    "truncate_prompt_tokens": value}, headers=AUTH, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"] == {"message": message, "type": "invalid_request_error",
                                 "param": "truncate_prompt_tokens", "code": None}


# ---- stream_options.continuous_usage_stats ----
def test_completion_continuous_usage_stats(api_client, case):
    """vLLM's continuous_usage_stats (with include_usage): every chunk carries the prompt's tokens and its
    choice's tokens so far; the final usage chunk is unchanged. Without include_usage there is no usage."""
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=5, n=2, temperature=0, stream=True,
                  extra_body={"ignore_eos": True})
    chunks = list(api_client.completions.create(**kwargs, stream_options={"include_usage": True,
                                                                          "continuous_usage_stats": True}))
    n_prompt = len(case["prompt_token_ids"])
    seen: dict[int, list[int]] = {0: [], 1: []}
    for chunk in chunks[:-1]:
        assert (chunk.usage.prompt_tokens, chunk.usage.total_tokens - chunk.usage.completion_tokens) == (
            n_prompt, n_prompt)
        seen[chunk.choices[0].index].append(chunk.usage.completion_tokens)
    assert seen == {0: [1, 2, 3, 4, 5], 1: [1, 2, 3, 4, 5]}
    assert chunks[-1].choices == [] and (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
        n_prompt, 10)
    quiet = list(api_client.completions.create(**kwargs, stream_options={"include_usage": False,
                                                                         "continuous_usage_stats": True}))
    assert all(c.usage is None for c in quiet) and len(quiet) == len(chunks) - 1


def test_chat_continuous_usage_stats(api_client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=4,
                  temperature=0, stream=True, extra_body={"ignore_eos": True})
    plain = list(api_client.chat.completions.create(**kwargs, stream_options={"include_usage": True}))
    chunks = list(api_client.chat.completions.create(**kwargs, stream_options={"include_usage": True,
                                                                               "continuous_usage_stats": True}))
    n_prompt = plain[-1].usage.prompt_tokens
    assert all(c.usage is None for c in plain[:-1])
    assert [(c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) for c in chunks[:-1]] == [
        (n_prompt, k, n_prompt + k) for k in range(5)]  # the role chunk, then one token per chunk
    assert chunks[-1].usage.completion_tokens == plain[-1].usage.completion_tokens == 4


# ---- return_token_ids ----
def test_completion_return_token_ids(api_client, case):
    """vLLM's return_token_ids: each choice carries prompt_token_ids and its token_ids (a stream: the
    prompt's on the choice's first chunk, each chunk's new ids)."""
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    out = api_client.completions.create(**kwargs).choices[0]
    assert out.prompt_token_ids == case["prompt_token_ids"]
    assert out.token_ids == case["greedy_token_ids"][:6]
    plain = api_client.completions.create(**{**kwargs, "extra_body": {}}).choices[0]
    assert getattr(plain, "token_ids", None) is None and out.text == plain.text
    chunks = list(api_client.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].prompt_token_ids == case["prompt_token_ids"]
    assert all(getattr(c.choices[0], "prompt_token_ids", None) is None for c in chunks[1:])
    assert [i for c in chunks for i in c.choices[0].token_ids] == case["greedy_token_ids"][:6]


def test_chat_return_token_ids(api_client, api_server):
    messages = [{"role": "user", "content": "Tell me a story"}]
    ids = httpx.post(f"{api_server.url}/tokenize", json={"model": MODEL, "messages": messages},
                     headers=AUTH, timeout=30).json()["tokens"]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    expected = api_client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                             extra_body={"return_token_ids": True}).choices[0].token_ids
    out = api_client.chat.completions.create(**kwargs)
    assert out.prompt_token_ids == ids and out.choices[0].token_ids == expected and len(expected) == 6
    chunks = list(api_client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].prompt_token_ids == ids
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    assert [i for c in chunks[1:] for i in c.choices[0].token_ids] == expected


# ---- priority ----
@pytest.fixture(scope="module")
def priority_server(stories_dir, tmp_path_factory):
    server = Server(stories_dir, tmp_path_factory.mktemp("priority") / "server.log",
                    "--scheduling-policy", "priority", "--max-num-seqs", "1")
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def test_priority_orders_admission_under_the_priority_policy(priority_server):
    """vLLM's priority reaches the engine: with one sequence at a time, a request of priority -10 that
    arrives after one of priority 10 (both waiting behind a long one) finishes first."""
    url = priority_server.url
    finished: list[str] = []
    lock = threading.Lock()

    def complete(name: str, priority: int) -> None:
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "priority": priority})
        assert r.status_code == 200, r.text
        with lock:
            finished.append(name)

    def waiting() -> int:
        return httpx.get(f"{url}/load", timeout=10).json()["waiting"]

    def wait_for(count: int) -> None:
        deadline = time.monotonic() + 30
        while waiting() < count:
            assert time.monotonic() < deadline, "the request never queued"
            time.sleep(0.002)

    body = {"prompt": PROMPT, "max_tokens": None, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as long_request:
        lines = long_request.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # it runs: the others must wait
        threads = [threading.Thread(target=complete, args=("low", 10))]
        threads[0].start()
        wait_for(1)
        threads.append(threading.Thread(target=complete, args=("high", -10)))
        threads[1].start()
        wait_for(2)
        assert httpx.get(f"{url}/load", timeout=10).json()["running"] == 1  # still the long one
        for _ in lines:
            pass
    for thread in threads:
        thread.join()
    assert finished == ["high", "low"]
