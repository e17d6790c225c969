"""OutputProcessor: incremental detokenization, stop strings, n > 1 aggregation, logprobs, abort."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tandem.engine.detokenizer import StopStrings
from tandem.engine.output_processor import OutputProcessor
from tandem.outputs import EngineCoreOutput, Logprob
from tandem.sampling_params import SamplingParams

STORIES = Path(__file__).resolve().parents[3] / "shared" / "models" / "stories260K" / "hf"
TEXT_POOL = ["Once", " upon", " a", " time", ",", " Lily", " é", "ö", " 日本", "語", "🎉", " 😀", "\n", " ",
             "  ", "naïve", " Ωμέγα", "x", "🇫🇷", "ü."]


@pytest.fixture(scope="module")
def stories_tok():
    if not (STORIES / "tokenizer.json").exists():
        pytest.skip(f"stories260K tokenizer not found at {STORIES} (shared models folder absent)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(STORIES))


@pytest.fixture(scope="module")
def bytelevel_tok():
    """A tiny GPT-2-style byte-level BPE, trained here so that merges split multi-byte characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["".join(TEXT_POOL) * 3, "Héllo wörld 日本語 🎉😀 text"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


def _whole_char_ids(tok) -> list[int]:
    """Non-special ids whose own text is complete characters (safe to drop anywhere in a sequence)."""
    special = set(tok.all_special_ids)
    return [i for i in range(len(tok)) if i not in special and "\ufffd" not in tok.decode([i])]


def _random_ids(tok, rng: random.Random, whole_ids: list[int]) -> list[int]:
    ids: list[int] = []
    for _ in range(rng.randint(1, 10)):
        r = rng.random()
        if r < 0.1:
            ids.append(rng.choice(tok.all_special_ids))
        elif r < 0.35:
            ids.append(rng.choice(whole_ids))
        else:
            text = "".join(rng.choices(TEXT_POOL, k=rng.randint(1, 4)))
            ids.extend(tok.encode(text, add_special_tokens=False))
    return ids


def _run(proc, request_id, ids, chunks, finish_reason="length", stop_reason=None, **extra):
    """Feed ``ids`` to one child in steps of the given sizes; the last step carries the finish."""
    results, pos, step = [], 0, 0
    while pos < len(ids) or step == 0:
        size = chunks[step % len(chunks)]
        new, pos, step = ids[pos : pos + size], pos + size, step + 1
        last = pos >= len(ids)
        out = EngineCoreOutput(request_id, new, finish_reason=finish_reason if last else None,
                               stop_reason=stop_reason if last else None, **extra)
        results.append(proc.process_outputs([out]))
    return results


def _add(proc, rid="r", params=None, kind="cumulative", parent=None, index=0, n=1, prompt_ids=(1,)):
    """Add a child; the default prompt is id 1 alone (stories260K's BOS "<s>")."""
    proc.add_request(rid, parent or rid, index, n, "prompt", list(prompt_ids), params or SamplingParams(),
                     output_kind=kind)


def _in_context(tok, prompt_ids, ids, skip_special=True):
    """What the output adds to the decoded prompt (vLLM's semantics for the completion text)."""
    prompt_text = tok.decode(prompt_ids, skip_special_tokens=skip_special)
    full = tok.decode(list(prompt_ids) + ids, skip_special_tokens=skip_special)
    assert full.startswith(prompt_text)
    return full[len(prompt_text) :]


def _random_prompt(tok, rng: random.Random, whole_ids: list[int]) -> list[int]:
    """Empty, BOS-like special ids, or random text/ids (long enough to exceed the context window)."""
    kind = rng.random()
    if kind < 0.15:
        return []
    if kind < 0.3:
        return [rng.choice(tok.all_special_ids)]
    return _random_ids(tok, rng, whole_ids) + _random_ids(tok, rng, whole_ids)


@pytest.mark.parametrize("tok_name", ["stories_tok", "bytelevel_tok"])
@pytest.mark.parametrize("skip_special", [True, False])
def test_streamed_text_equals_decode_on_random_sequences(request, tok_name, skip_special):
    tok = request.getfixturevalue(tok_name)
    rng = random.Random(hash((tok_name, skip_special)) % 1000)
    whole_ids = _whole_char_ids(tok)
    params = SamplingParams(skip_special_tokens=skip_special)
    for case in range(150):
        ids, prompt = _random_ids(tok, rng, whole_ids), _random_prompt(tok, rng, whole_ids)
        expected = _in_context(tok, prompt, ids, skip_special)
        if tok_name == "bytelevel_tok":  # byte-level BPE decodes token by token: the prompt changes nothing
            assert expected == tok.decode(ids, skip_special_tokens=skip_special)
        chunks = [rng.randint(1, 3) for _ in range(5)]
        proc = OutputProcessor(tok)
        _add(proc, "d", params, "delta", prompt_ids=prompt)
        _add(proc, "c", params, "cumulative", prompt_ids=prompt)
        deltas = [r.request_outputs[0].outputs[0].text for r in _run(proc, "d", ids, chunks)]
        cumulative = [r.request_outputs[0].outputs[0].text for r in _run(proc, "c", ids, chunks)]
        assert "".join(deltas) == expected, (case, ids)
        assert cumulative[-1] == expected, (case, ids)
        assert all(expected.startswith(text) for text in cumulative)
        if "\ufffd" not in expected:
            assert not any("\ufffd" in d for d in deltas), (case, ids, deltas)
        assert not proc.has_unfinished_requests()


def test_multibyte_characters_split_across_tokens_are_held_back(bytelevel_tok):
    tok = bytelevel_tok
    text = "Hé wö 日本 🎉 x"
    ids = tok.encode(text, add_special_tokens=False)
    split = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]
    assert split  # some token boundary falls inside a character: the test is meaningful
    proc = OutputProcessor(tok)
    _add(proc, kind="delta")
    deltas = [r.request_outputs[0].outputs[0].text for r in _run(proc, "r", ids, [1])]
    assert all(deltas[k - 1] == "" or not deltas[k - 1].endswith("\ufffd") for k in split)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == text


def test_trailing_incomplete_character_is_released_at_finish(stories_tok):
    ids = stories_tok.encode("a 日", add_special_tokens=False)[:-1]  # drop the last byte of "日"
    expected = stories_tok.decode(ids)
    assert expected.endswith("\ufffd")
    proc = OutputProcessor(stories_tok)
    _add(proc)
    assert _run(proc, "r", ids, [1])[-1].request_outputs[0].outputs[0].text == expected


def _story_ids(tok, text="Once upon a time, there was a little girl"):
    return tok.encode(text, add_special_tokens=False)


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(stories_tok):
    proc = OutputProcessor(stories_tok)
    _add(proc, "0_p", SamplingParams(stop=["xyz", "n a ti"]), "delta", parent="p")
    ids = _story_ids(stories_tok)  # ▁Once ▁upon ▁a ▁time ...: "n a ti" spans three tokens
    results = _run(proc, "0_p", ids, [1], finish_reason=None)
    assert [r.reqs_to_abort for r in results[:4]] == [[], [], [], ["0_p"]]
    streamed = [r.request_outputs[0].outputs[0].text for r in results[:4]]
    assert "".join(streamed) == "Once upo"
    final = results[3].request_outputs[0]
    assert final.finished and final.request_id == "p"
    assert (final.outputs[0].finish_reason, final.outputs[0].stop_reason) == ("stop", "n a ti")
    assert all(r.request_outputs == [] for r in results[4:])  # later tokens of an aborted child: ignored
    assert not proc.has_unfinished_requests()


def test_possible_stop_prefix_is_held_then_released(stories_tok):
    proc = OutputProcessor(stories_tok)
    _add(proc, params=SamplingParams(stop=["upon the"]), kind="delta")
    ids = _story_ids(stories_tok, "Once upon a time")
    deltas = [r.request_outputs[0].outputs[0].text for r in _run(proc, "r", ids, [1])]
    assert deltas == ["Once", " ", "upon a", " time"]


def test_include_stop_str_in_output_and_cumulative_kind(stories_tok):
    params = SamplingParams(stop=["n a ti"], include_stop_str_in_output=True)
    proc = OutputProcessor(stories_tok)
    _add(proc, params=params)
    results = _run(proc, "r", _story_ids(stories_tok), [2], finish_reason=None)
    texts = [r.request_outputs[0].outputs[0].text for r in results if r.request_outputs]
    assert texts == ["Once upon", "Once upon a ti"]
    assert results[1].request_outputs[0].outputs[0].token_ids == _story_ids(stories_tok)[:4]


def test_stop_string_inside_multi_token_step_drops_later_tokens(stories_tok):
    # A speculative step brings several tokens at once; those after the stop string are dropped so
    # token ids (and usage) equal plain decoding, which would have stopped at that token.
    proc = OutputProcessor(stories_tok)
    _add(proc, params=SamplingParams(stop=[","], logprobs=1))
    ids = _story_ids(stories_tok)
    completes = next(k for k in range(1, 8) if "," in stories_tok.decode(ids[:k]))
    assert completes < 7  # the step below carries tokens after the one completing the stop string
    positions = [{t: Logprob(-0.5, 1)} for t in ids[:7]]
    result = proc.process_outputs([EngineCoreOutput("r", ids[:7], new_logprobs=positions)])
    out = result.request_outputs[0].outputs[0]
    assert (out.text, out.token_ids, out.stop_reason, result.reqs_to_abort) == (
        "Once upon a time", ids[:completes], ",", ["r"])
    assert len(out.logprobs) == completes and out.cumulative_logprob == -0.5 * completes


def test_eos_and_stop_token_text_hidden_unless_included(stories_tok):
    ids = _story_ids(stories_tok, "Once upon") + [stories_tok.eos_token_id]
    # NOTE: with special tokens shown, the prompt "<s>" precedes "▁Once", so its space stays (as in vLLM).
    for include, expected in [(False, " Once upon"), (True, " Once upon</s>")]:
        proc = OutputProcessor(stories_tok)
        params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
        _add(proc, params=params)
        out = _run(proc, "r", ids, [1], finish_reason="stop")[-1].request_outputs[0].outputs[0]
        assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == (expected, ids, "stop", None)
    proc = OutputProcessor(stories_tok)
    _add(proc)
    ids = _story_ids(stories_tok, "Once upon a")  # stop token id 261 ("▁a"), not special
    out = _run(proc, "r", ids, [1], finish_reason="stop", stop_reason=261)[-1].request_outputs[0].outputs[0]
    assert (out.text, out.stop_reason) == ("Once upon", 261)


@pytest.mark.parametrize("reason", ["length", "abort"])
def test_finish_reasons_pass_through(stories_tok, reason):
    proc = OutputProcessor(stories_tok)
    _add(proc)
    ids = _story_ids(stories_tok, "Once upon")
    out = _run(proc, "r", ids, [1], finish_reason=reason)[-1].request_outputs[0]
    assert out.finished and out.outputs[0].finish_reason == reason and out.outputs[0].text == "Once upon"
    assert out.outputs[0].cumulative_logprob is None and out.outputs[0].logprobs is None


def test_n2_aggregation_ordering_and_finish(stories_tok):
    proc = OutputProcessor(stories_tok)
    for index in (1, 0):
        _add(proc, f"{index}_p", parent="p", index=index, n=2)
    a, b = _story_ids(stories_tok, "Once upon"), _story_ids(stories_tok, "a little girl")
    first = proc.process_outputs([EngineCoreOutput("1_p", b[:1], num_cached_tokens=2)]).request_outputs
    assert len(first) == 1 and [o.index for o in first[0].outputs] == [0, 1]
    assert [o.text for o in first[0].outputs] == ["", "a"] and first[0].num_cached_tokens == 2
    step = proc.process_outputs([EngineCoreOutput("0_p", a, finish_reason="length"),
                                 EngineCoreOutput("1_p", b[1:2])]).request_outputs[0]
    assert not step.finished and step.outputs[0].finished and not step.outputs[1].finished
    last = proc.process_outputs([EngineCoreOutput("1_p", b[2:], finish_reason="length")]).request_outputs[0]
    assert last.finished and [o.text for o in last.outputs] == ["Once upon", "a little girl"]
    assert not proc.has_unfinished_requests()


def test_n2_delta_mode_reports_only_changed_children(stories_tok):
    proc = OutputProcessor(stories_tok)
    for index in (0, 1):
        _add(proc, f"{index}_p", parent="p", index=index, n=2, kind="delta")
    ids = _story_ids(stories_tok, "Once upon a")
    out = proc.process_outputs([EngineCoreOutput("1_p", ids[:2])]).request_outputs[0]
    assert [(o.index, o.text, o.token_ids) for o in out.outputs] == [(1, "Once upon", ids[:2])]
    out = proc.process_outputs([EngineCoreOutput("1_p", ids[2:]), EngineCoreOutput("0_p", ids[:1])])
    assert [(o.index, o.text, o.token_ids) for o in out.request_outputs[0].outputs] == [
        (0, "Once", ids[:1]), (1, " a", ids[2:])]


def test_final_kind_reports_once(stories_tok):
    proc = OutputProcessor(stories_tok)
    _add(proc, kind="final")
    results = _run(proc, "r", _story_ids(stories_tok, "Once upon a time"), [1])
    assert [len(r.request_outputs) for r in results] == [0, 0, 0, 1]
    assert results[-1].request_outputs[0].outputs[0].text == "Once upon a time"


def _position(token_ids_logprobs):
    return {t: Logprob(lp, rank) for rank, (t, lp) in enumerate(token_ids_logprobs, start=1)}


def test_logprobs_decoded_tokens_and_cumulative(stories_tok):
    proc = OutputProcessor(stories_tok)
    _add(proc, params=SamplingParams(logprobs=1), kind="delta")
    ids = _story_ids(stories_tok, "Once upon")
    positions = [_position([(ids[0], -0.5), (2, -1.0)]), _position([(5, -0.25), (ids[1], -2.0)])]
    out1 = proc.process_outputs([EngineCoreOutput("r", ids[:1], new_logprobs=positions[:1])])
    out2 = proc.process_outputs([EngineCoreOutput("r", ids[1:], new_logprobs=positions[1:],
                                                  finish_reason="length")])
    c1, c2 = out1.request_outputs[0].outputs[0], out2.request_outputs[0].outputs[0]
    assert c1.logprobs == positions[:1] and c2.logprobs == positions[1:]
    assert c1.cumulative_logprob == -0.5 and c2.cumulative_logprob == -2.5
    # Sampled tokens: their text in context ("Once" starts the text after BOS); alternatives: alone.
    assert [lp.decoded_token for lp in positions[0].values()] == ["Once", "</s>"]
    assert [lp.decoded_token for lp in positions[1].values()] == [stories_tok.decode([5]), " upon"]


def _greedy_logprobs(tok, ids, alternatives):
    """Positions where the sampled id ranks first and the given alternative ids follow."""
    return [_position([(t, -0.1)] + [(a, -1.0 - k) for k, a in enumerate(alternatives) if a != t])
            for t in ids]


@pytest.mark.parametrize("chunks", [[1], [3]])
def test_logprob_tokens_join_into_text_and_keep_spaces(stories_tok, chunks):
    tok = stories_tok
    prompt = tok("Lily went to the")["input_ids"]
    ids = tok.encode("park with her mom. 日本", add_special_tokens=False) + [tok.eos_token_id]  # "▁park", ...
    there, comma = tok.convert_tokens_to_ids("▁there"), tok.convert_tokens_to_ids(",")
    positions = _greedy_logprobs(tok, ids, [there, comma, tok.eos_token_id])
    proc = OutputProcessor(tok)
    _add(proc, params=SamplingParams(logprobs=3), kind="delta", prompt_ids=prompt)
    text, tokens, pos = "", [], 0
    while pos < len(ids):
        step = ids[pos : pos + chunks[0]]
        last = pos + len(step) >= len(ids)
        out = proc.process_outputs([EngineCoreOutput("r", step, new_logprobs=positions[pos : pos + len(step)],
                                                     finish_reason="stop" if last else None)])
        completion = out.request_outputs[0].outputs[0]
        text += completion.text
        tokens += [p[t].decoded_token for t, p in zip(completion.token_ids, completion.logprobs, strict=True)]
        pos += len(step)
    assert text == " park with her mom. 日本" == _in_context(tok, prompt, ids[:-1])
    words = tok.convert_ids_to_tokens(tok.encode("park with her mom.", add_special_tokens=False))
    assert "".join(tokens[:-1]) == text and tokens[: len(words)] == [w.replace("▁", " ") for w in words]
    assert tokens[0] == " p" and tokens[3] == " with"  # "▁p" "ar" "k" "▁with": spaces kept
    assert tokens[-1] == "</s>"  # the EOS text is not in the completion: its text alone
    # Byte-fallback tokens of "日本": the last byte of each character carries it, the others add "".
    assert tokens[-7:-1] == ["", "", "日", "", "", "本"]
    alternatives = {lp.decoded_token for sampled, p in zip(ids, positions, strict=True)
                    for t, lp in p.items() if t != sampled}
    assert alternatives == {" there", ",", "</s>"}


def test_prompt_context_for_bos_only_and_empty_prompts(stories_tok):
    tok = stories_tok
    ids = _story_ids(tok, "Once upon a time")
    for prompt, skip, expected in [([1], True, "Once upon a time"), ([], True, "Once upon a time"),
                                   ([1], False, " Once upon a time"), ([1, 403, 407], True, " Once upon a time")]:
        proc = OutputProcessor(tok)
        _add(proc, params=SamplingParams(skip_special_tokens=skip), kind="delta", prompt_ids=prompt)
        deltas = [r.request_outputs[0].outputs[0].text for r in _run(proc, "r", ids, [1])]
        assert "".join(deltas) == expected == _in_context(tok, prompt, ids, skip), (prompt, skip)


def test_prompt_ending_inside_a_character(bytelevel_tok):
    tok = bytelevel_tok
    full = tok.encode("Hé wö 日本 🎉 x", add_special_tokens=False)
    cuts = [k for k in range(1, len(full)) if tok.decode(full[:k]).endswith("\ufffd")]
    assert cuts
    for k in cuts:
        prompt, ids = full[:k], full[k:]
        start = len(tok.decode(prompt).rstrip("\ufffd"))  # the cut character is shown whole in the output
        proc = OutputProcessor(tok)
        _add(proc, kind="delta", prompt_ids=prompt)
        deltas = [r.request_outputs[0].outputs[0].text for r in _run(proc, "r", ids, [1])]
        assert "".join(deltas) == tok.decode(full)[start:] and "\ufffd" not in "".join(deltas), k
        proc = OutputProcessor(tok)  # nothing generated but EOS: the prompt's bytes are not output
        _add(proc, prompt_ids=prompt)
        out = proc.process_outputs([EngineCoreOutput("r", [0], finish_reason="stop")])
        assert out.request_outputs[0].outputs[0].text == ""
        proc = OutputProcessor(tok)  # the character is never completed: only the output's text
        _add(proc, prompt_ids=prompt)
        x = tok.encode(" x", add_special_tokens=False)
        assert _run(proc, "r", x, [1])[-1].request_outputs[0].outputs[0].text == " x" == _in_context(tok, prompt, x)


def test_abort_by_parent_or_child(stories_tok):
    for abort_id in ("p", "1_p"):
        proc = OutputProcessor(stories_tok)
        for index in (0, 1):
            _add(proc, f"{index}_p", parent="p", index=index, n=2)
        proc.process_outputs([EngineCoreOutput("0_p", [403], finish_reason="length")])
        assert proc.has_unfinished_requests() and proc.get_num_unfinished_requests() == 1
        assert proc.abort_request(abort_id) == ["1_p"]
        assert not proc.has_unfinished_requests()
        assert proc.process_outputs([EngineCoreOutput("1_p", [403])]).request_outputs == []
        assert proc.abort_request(abort_id) == []


def test_add_request_validation(stories_tok):
    proc = OutputProcessor(stories_tok)
    _add(proc, "0_p", parent="p", n=2)
    with pytest.raises(ValueError, match="already being processed"):
        _add(proc, "0_p", parent="p", n=2)
    with pytest.raises(ValueError, match="out of range"):
        _add(proc, "2_p", parent="p", index=2, n=2)
    with pytest.raises(ValueError, match="index 0"):
        _add(proc, "x_p", parent="p", index=0, n=2)
    with pytest.raises(ValueError, match="output_kind"):
        _add(proc, "q", kind="stream")


def test_stop_string_helpers():
    assert StopStrings(["stop"]).find("abc stop def", 5) == (4, "stop")
    assert StopStrings(["stop"]).find("abc stop def", 8) is None  # fully inside the searched text
    assert StopStrings(["cd", "ab"]).find("xx ab cd", 4) == (3, "ab")  # earliest wins
    assert StopStrings(["upon a"]).partial_length("Once up") == 2
    assert StopStrings(["xyz", "p"]).partial_length("Once up") == 0
    assert StopStrings(["aab"]).partial_length("aa") == 2


def test_stop_strings_match_brute_force():
    """find / partial_length equal their definitions on random texts over a small alphabet (many hits)."""
    rng = random.Random(0)
    for _ in range(300):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 6))]
        text = "".join(rng.choice("abc ") for _ in range(rng.randint(0, 12)))
        new_from = rng.randint(0, len(text))
        matches = [(i, k, stop) for k, stop in enumerate(stops) for i in range(len(text) - len(stop) + 1)
                   if text.startswith(stop, i) and i + len(stop) > new_from]
        expected = min(matches)[::2] if matches else None
        assert StopStrings(stops).find(text, new_from) == expected
        partial = max((n for stop in stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)
        assert StopStrings(stops).partial_length(text) == partial
