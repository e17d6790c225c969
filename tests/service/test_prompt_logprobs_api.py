"""Prompt logprobs over HTTP: ``echo`` + ``logprobs`` (lm-evaluation-harness's request), ``max_tokens`` 0,
vLLM's ``prompt_logprobs`` field; values against transformers (stories260K, float32); usage's cached tokens."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from live_server import AUTH, MODEL, ROOT, sse_data

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun."


@pytest.fixture(scope="module")
def server(api_server):
    return api_server


@pytest.fixture(scope="module")
def reference(stories_dir):
    """(prompt ids, transformers' log-softmax [P, vocab]) for PROMPT."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(stories_dir))(PROMPT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return ids, torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def post(server, path, body):
    r = httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, headers=AUTH, timeout=60)
    return r


def test_lm_eval_loglikelihood_request(server, reference):
    """lm-evaluation-harness ``local-completions`` sends exactly this for log-likelihood tasks."""
    ids, ref = reference
    r = post(server, "/v1/completions", {"prompt": [ids], "max_tokens": 1, "logprobs": 1, "echo": True,
                                         "temperature": 0.0, "seed": 1234})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert PROMPT in choice["text"]  # the ids decoded (with "<s>")
    assert lp["text_offset"][0] == 0 and lp["tokens"][0] == "<s>"
    for i in range(1, len(ids)):
        assert abs(lp["token_logprobs"][i] - ref[i - 1, ids[i]].item()) < 1e-4, i
        top = lp["top_logprobs"][i]
        # the top token, plus the prompt token when it is not the top one (OpenAI: up to logprobs + 1)
        assert len(top) == (1 if int(ref[i - 1].argmax()) == ids[i] else 2)
        assert abs(max(top.values()) - ref[i - 1].max().item()) < 1e-4
    # lm-eval's parse_logprobs: sum over the continuation, greedy if each token is its top one.
    continuation = lp["token_logprobs"][1:-1]
    assert sum(continuation) == pytest.approx(sum(ref[i - 1, ids[i]].item() for i in range(1, len(ids))), abs=1e-3)
    assert r.json()["usage"]["completion_tokens"] == 1


def test_max_tokens_0_with_echo_returns_the_prompt_alone(server, reference):
    ids, ref = reference
    for stream in (False, True):
        r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0,
                                             "stream": stream, **({"stream_options": {"include_usage": True}}
                                                                  if stream else {})})
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(d) for d in sse_data(r) if d != "[DONE]"]
            (choice,) = chunks[0]["choices"]
            usage = chunks[-1]["usage"]
            assert len(chunks) == 2 and chunks[-1]["choices"] == []
        else:
            (choice,), usage = r.json()["choices"], r.json()["usage"]
        assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["tokens"]) == len(ids)
        assert choice["logprobs"]["token_logprobs"][0] is None
        assert abs(choice["logprobs"]["token_logprobs"][-1] - ref[-2, ids[-1]].item()) < 1e-4
        assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == len(ids)


def test_max_tokens_0_without_echo_is_400(server):
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"


def test_vllm_prompt_logprobs_field(server, reference):
    ids, ref = reference
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["logprobs"] is None
    prompt_logprobs = choice["prompt_logprobs"]
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        entry = prompt_logprobs[i][str(ids[i])]
        assert abs(entry["logprob"] - ref[i - 1, ids[i]].item()) < 1e-4
        assert entry["rank"] == int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1
        assert isinstance(entry["decoded_token"], str)
        assert 2 <= len(prompt_logprobs[i]) <= 3
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                 "max_tokens": 1, "prompt_logprobs": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["prompt_logprobs"][0] is None and len(chat.json()["prompt_logprobs"]) > 3


def test_echo_logprobs_stream_starts_with_the_prompt(server, reference):
    ids, _ = reference
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 1,
                                         "temperature": 0, "stream": True})
    chunks = [json.loads(d)["choices"][0] for d in sse_data(r) if d != "[DONE]"]
    assert chunks[0]["text"].startswith(PROMPT)
    assert len(chunks[0]["logprobs"]["tokens"]) == len(ids) + 1
    assert chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert sum(len(c["logprobs"]["tokens"]) for c in chunks) == len(ids) + 3


def test_cached_tokens_count_a_repeated_prompt(server):
    prompt = "Tom had a big red ball. He liked to throw it high in the sky and catch it with both hands."
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = post(server, "/v1/completions", body).json()["usage"]
    n_prompt = first["prompt_tokens"]
    assert n_prompt > 16
    again = post(server, "/v1/completions", body).json()["usage"]
    assert again["prompt_tokens_details"] == {"cached_tokens": (n_prompt - 1) // 16 * 16}
    stream = post(server, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    usage = json.loads(sse_data(stream)[-2])["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": (n_prompt - 1) // 16 * 16}
    chat_body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
    post(server, "/v1/chat/completions", chat_body)
    chat = post(server, "/v1/chat/completions", chat_body).json()["usage"]
    assert chat["prompt_tokens_details"]["cached_tokens"] == (chat["prompt_tokens"] - 1) // 16 * 16


def test_echo_max_tokens_0_takes_a_prompt_that_fills_the_context(server, reference):
    ids, _ = reference
    full = (ids * 20)[:512]  # stories260K's max_model_len: no room for a token, none is needed
    r = post(server, "/v1/completions", {"prompt": [full], "max_tokens": 0, "echo": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert len(choice["logprobs"]["token_logprobs"]) == 512 and choice["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 0
    assert choice["prompt_logprobs"] is None  # vLLM's field only when asked for
    r = post(server, "/v1/completions", {"prompt": [full + [5]], "max_tokens": 0, "echo": True})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_text_offset_of_an_echoed_text_prompt_indexes_the_text(server):
    for stream in (False, True):
        r = post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 3, "echo": True,
                                             "logprobs": 0, "temperature": 0, "stream": stream})
        if stream:
            chunks = [json.loads(d)["choices"][0] for d in sse_data(r) if d != "[DONE]"]
        else:
            chunks = r.json()["choices"]
        text = "".join(c["text"] for c in chunks)
        offsets = [o for c in chunks for o in c["logprobs"]["text_offset"]]
        tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
        assert offsets[:5] == [0, 0, 4, 9, 11], offsets  # "<s>" is zero-length; " upon" starts at its space
        assert offsets == sorted(offsets) and offsets[-1] < len(text)
        assert all(text[o:].startswith(t) for o, t in zip(offsets[2:], tokens[2:], strict=True)), (text, tokens)


def test_lm_eval_local_task_loglikelihoods_equal_transformers(server, stories_dir):
    """benchmarks/lm_eval_local's 20 items (60 choices) in one request of lm-eval's shape: every
    continuation's log-likelihood and greediness as transformers computes them, so lm-eval's accuracy
    through Tandem is transformers' (run.py checks the real lm-eval run the same way)."""
    import importlib.util

    from transformers import AutoTokenizer

    spec = importlib.util.spec_from_file_location("lm_eval_score", ROOT / "benchmarks/lm_eval_local/score.py")
    score = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(score)
    items = score.load_items()
    tokenizer = AutoTokenizer.from_pretrained(str(stories_dir))
    encoded = [score.encode_pair(tokenizer, c, k) for c, k in score.requests_of(items)]
    got = score.tandem_loglikelihoods(server.url, MODEL, encoded, AUTH)
    ref = score.reference_loglikelihoods(stories_dir, encoded)
    assert len(got) == len(ref) == 60
    for (ll, greedy), (ref_ll, ref_greedy) in zip(got, ref, strict=True):
        assert abs(ll - ref_ll) < 1e-3 and greedy == ref_greedy
    assert score.accuracies(items, [ll for ll, _ in got]) == score.accuracies(items, [ll for ll, _ in ref])
