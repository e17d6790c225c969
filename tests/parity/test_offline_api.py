"""The offline API end to end: bad input errors, n, seeds, stop strings, logprobs, default model."""

from __future__ import annotations

import math

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.processor import PromptError
from tandem.errors import ContextLengthExceededError
from tandem.sampling_params import SamplingParamsError


@pytest.fixture(scope="module")
def llm(stories_dir):
    return LLM(str(stories_dir), dtype="float32", progress=False)


def test_empty_prompt_raises(llm):
    with pytest.raises(PromptError, match="empty"):
        llm.generate("", SamplingParams(max_tokens=4))
    with pytest.raises(PromptError, match="empty"):
        llm.generate({"prompt_token_ids": []}, SamplingParams(max_tokens=4))


def test_prompt_longer_than_context_raises(llm):
    ids = [5] * llm.engine.max_model_len
    with pytest.raises(ContextLengthExceededError, match="maximum context length is 512"):
        llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=4))
    # Nothing was queued by the failed call.
    assert not llm.engine.has_unfinished_requests()


def test_out_of_vocab_token_raises(llm):
    with pytest.raises(PromptError, match="out of the vocabulary"):
        llm.generate({"prompt_token_ids": [1, 512]}, SamplingParams(max_tokens=4))


@pytest.mark.parametrize(
    "kwargs, param",
    [({"max_tokens": -1}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"), ({"top_p": 0.0}, "top_p"),
     ({"top_p": 1.5}, "top_p"), ({"temperature": -0.5}, "temperature"), ({"n": 0}, "n"),
     ({"top_k": -3}, "top_k"), ({"min_p": 2.0}, "min_p"), ({"logprobs": 21}, "logprobs")],
)
def test_bad_sampling_params_raise(kwargs, param):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_unknown_model_path_raises(tmp_path):
    with pytest.raises((FileNotFoundError, ValueError), match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist"), progress=False)


def test_context_limit_finishes_with_length(llm):
    out = llm.generate({"prompt_token_ids": [1] + [400] * 505},
                       SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 512 - 506
    assert out.outputs[0].finish_reason == "length"


def test_n_and_seed(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=20)
    a = llm.generate("Once upon a time", params)[0]
    b = llm.generate(["The dog", "Once upon a time"], params)[1]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1


def test_stop_string_cut_and_reason(llm):
    full = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert "Lily" in full.text
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40, stop=["Lily"]))[0]
    comp = out.outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason == "Lily"
    assert comp.text == full.text[: full.text.index("Lily")]


def test_stop_token_id_and_min_tokens(llm):
    full = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    stop_id = full.token_ids[5]
    out = llm.generate("Once upon a time",
                       SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id]))[0].outputs[0]
    first = full.token_ids.index(stop_id)
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # min_tokens suppresses the stop id (and EOS) until that many tokens exist.
    held = llm.generate("Once upon a time", SamplingParams(
        temperature=0, max_tokens=30, stop_token_ids=[stop_id], min_tokens=first + 3))[0].outputs[0]
    assert len(held.token_ids) >= first + 3
    assert stop_id not in held.token_ids[: first + 3]


def test_logprobs_are_log_softmax(llm):
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 5
    total = 0.0
    for tok, pos in zip(comp.token_ids, comp.logprobs, strict=True):
        assert tok in pos and pos[tok].rank == 1  # greedy picks the most likely token
        assert len(pos) == 3
        assert all(lp.logprob <= 0.0 for lp in pos.values())
        total += pos[tok].logprob
    assert math.isclose(comp.cumulative_logprob, total, rel_tol=1e-6)


# NOTE: LLM() with no model (the default, SmolLM2 Q4_1) answering Paris: tests/unit/test_resolve_model.py


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chat_stream_equals_chat_and_per_conversation_params(llm):
    conv = [{"role": "user", "content": "Tell me a story"}]
    params = SamplingParams(temperature=0, max_tokens=24)
    whole = llm.chat(conv, params, chat_template=CHATML)[0].outputs[0].text
    assert "".join(llm.chat_stream(conv, params, chat_template=CHATML)) == whole
    outs = llm.chat([conv, conv], [params, SamplingParams(temperature=0, max_tokens=3)], chat_template=CHATML)
    assert outs[0].outputs[0].text == whole and len(outs[1].outputs[0].token_ids) == 3


def test_chat_bad_messages_raise(llm):
    with pytest.raises(PromptError, match="must not be empty"):
        llm.chat([], chat_template=CHATML)
    with pytest.raises(PromptError, match="not one dict"):
        llm.chat({"role": "user", "content": "hi"}, chat_template=CHATML)


def test_closing_a_stream_early_frees_blocks(llm):
    stream = llm.chat_stream([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=50),
                             chat_template=CHATML)
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv_cache_manager.usage == 0.0


@pytest.mark.parametrize(
    "kwargs, param",
    [({"seed": 2**64}, "seed"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
     ({"temperature": float("inf")}, "temperature"),
     ({"max_tokens": True}, "max_tokens"), ({"temperature": "0.5"}, "temperature")],
)
def test_bad_types_raise(kwargs, param):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_stop_token_out_of_vocab_and_seed_wrap(llm):
    with pytest.raises(SamplingParamsError, match="out of the vocabulary"):
        llm.generate("Hi", SamplingParams(stop_token_ids=[10**6], min_tokens=1))
    out = llm.generate("Hi", SamplingParams(n=2, seed=2**63 - 1, max_tokens=4))[0]
    assert len(out.outputs) == 2


def test_folder_without_tokenizer_names_it(stories_dir, tmp_path):
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((stories_dir / name).read_bytes())
    with pytest.raises(FileNotFoundError, match="expected tokenizer.json"):
        LLM(str(tmp_path), progress=False)


def test_min_tokens_applies_to_stop_strings(llm):
    out = llm.generate("Once upon a time",
                       SamplingParams(temperature=0, max_tokens=40, stop=[","], min_tokens=5))[0].outputs[0]
    assert len(out.token_ids) > 5
    assert out.finish_reason in ("stop", "length")
    free = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert free.text.startswith(",")  # without min_tokens the stop string would end it at once
