"""The gateway's tiered comparator on hand-made answer pairs, tier by tier, and the noise baseline."""

from __future__ import annotations

import json

import pytest

from tandem.gateway.capture import Capture, StreamTap
from tandem.gateway.compare import Comparison, Diff, compare_answers, divergence_report, json_shape

GREEDY = {"model": "m", "prompt": "p", "temperature": 0}
SAMPLED = {"model": "m", "prompt": "p", "temperature": 0.8}


def completion(*texts: str, finish: str = "length", usage=(3, 4), logprobs=None) -> Capture:
    choices = [{"index": i, "text": t, "finish_reason": finish, "logprobs": (logprobs or {}).get(i)}
               for i, t in enumerate(texts)]
    body = {"object": "text_completion", "choices": choices,
            "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1]}}
    return Capture(status=200, body=body, usage=body["usage"])


def chat(content: str | None, tool_calls=None, finish="stop") -> Capture:
    message = {"role": "assistant", "content": content}
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    body = {"choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 6}}
    return Capture(status=200, body=body, usage=body["usage"])


def error(status: int, type_: str, code: str | None) -> Capture:
    return Capture(status=status, body={"error": {"message": "x", "type": type_, "param": None, "code": code}})


def stream(chunks: list[str], role: bool = True, done: bool = True, usage: bool = True) -> Capture:
    events = []
    if role:
        events.append({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
    events += [{"choices": [{"index": 0, "delta": {"content": c}, "finish_reason": None}]} for c in chunks]
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    if usage:
        events.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": len(chunks)}})
    tap = StreamTap(0.0, keep_events=True)
    tap.feed(b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + (b"data: [DONE]\n\n" if done else b""))
    return tap.finish()


def tiers(c: Comparison) -> list[str]:
    return [d.tier for d in c.diffs]


def test_identical_greedy_answers_have_no_difference():
    assert compare_answers(GREEDY, completion("Once upon"), completion("Once upon")).diffs == []


def test_text_tier_only_for_deterministic_requests():
    a, b = completion("Once upon"), completion("Once there")
    got = compare_answers(GREEDY, a, b)
    assert got.diffs == [Diff("text", "choice 0: texts differ from character 5 (lengths 9 vs 10)")] and got.diverged
    assert compare_answers(SAMPLED, a, b).diffs == []
    assert tiers(compare_answers({**SAMPLED, "seed": 7}, a, b)) == ["text"]


def _lp(tokens: list[str], tops: list[list[str]]) -> dict:
    return {"tokens": tokens, "top_logprobs": [{t: -1.0 for t in top} for top in tops]}


def test_first_divergence_within_each_others_top_k_is_a_near_tie():
    a = completion("The cat", logprobs={0: _lp(["The", " cat"], [["The"], [" cat", " dog"]])})
    b = completion("The dog", logprobs={0: _lp(["The", " dog"], [["The"], [" dog", " cat"]])})
    got = compare_answers(GREEDY, a, b)
    assert tiers(got) == ["near_tie"] and not got.diverged
    c = completion("The dog", logprobs={0: _lp(["The", " dog"], [["The"], [" dog", " cow"]])})
    assert tiers(compare_answers(GREEDY, a, c)) == ["text"]  # " cat" not in c's top-k


def test_chat_logprobs_shape_is_read_for_the_near_tie():
    def with_lp(text: str, token: str, top: list[str]) -> Capture:
        cap = chat(text)
        cap.body["choices"][0]["logprobs"] = {"content": [
            {"token": token, "logprob": -0.1, "top_logprobs": [{"token": t, "logprob": -1} for t in top]}]}
        return cap

    assert tiers(compare_answers(GREEDY, with_lp("Yes", "Yes", ["Yes", "No"]), with_lp("No", "No", ["No", "Yes"]))) \
        == ["near_tie"]


def test_finish_reason_and_usage_tiers():
    got = compare_answers(GREEDY, completion("a", finish="length"), completion("a", finish="stop", usage=(3, 2)))
    assert got.diffs == [Diff("finish_reason", "['length'] vs ['stop']"), Diff("usage", "completion_tokens 4 vs 2")]
    assert compare_answers(SAMPLED, completion("a", usage=(3, 4)), completion("b", usage=(9, 1))).diffs == [
        Diff("usage", "prompt_tokens 3 vs 9")]


def test_stream_shape_tier():
    base = stream(["Hel", "lo"])
    assert compare_answers(GREEDY, base, stream(["Hel", "lo"])).diffs == []
    assert tiers(compare_answers(GREEDY, base, stream(["Hello"]))) == ["usage", "stream_shape"]
    got = compare_answers(GREEDY, base, stream(["Hel", "lo"], role=False, done=False))
    assert [d.detail for d in got.diffs if d.tier == "stream_shape"] == [
        "role chunk True vs False", "[DONE] True vs False", "choice chunks 4 vs 3"]


def test_error_status_and_body_tiers():
    assert compare_answers(GREEDY, completion("a"), error(400, "invalid_request_error", None)).diffs == [
        Diff("status", "HTTP 200 vs 400")]
    same = compare_answers(GREEDY, error(400, "invalid_request_error", None), error(400, "invalid_request_error", None))
    assert same.diffs == []
    other = compare_answers(GREEDY, error(400, "invalid_request_error", None), error(400, "BadRequestError", "400"))
    assert tiers(other) == ["error_body"]


def test_json_validity_schema_and_shape_tiers():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    req = {**SAMPLED, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    assert compare_answers(req, chat('{"n": 1}'), chat('{"n": 2}')).diffs == []
    assert [d.detail for d in compare_answers(req, chat('{"n": 1}'), chat('{"n": 1')).diffs] == [
        "choice 0: valid JSON True vs False"]
    got = compare_answers(req, chat('{"n": 1}'), chat('{"n": "one"}'))
    assert [d.detail for d in got.diffs] == ["choice 0: matches the schema True vs False",
                                             "choice 0: JSON shapes differ"]
    # without a JSON format, two JSON texts are still compared by shape; prose is not
    assert tiers(compare_answers(SAMPLED, chat('{"a": [1]}'), chat('{"b": [1]}'))) == ["json"]
    assert compare_answers(SAMPLED, chat("hi"), chat("{}")).diffs == []
    assert json_shape({"a": [1.5], "b": None, "c": True}) == {"a": ["number"], "b": "NoneType", "c": "bool"}


def _call(name: str, args: str) -> dict:
    return {"id": "c", "type": "function", "function": {"name": name, "arguments": args}}


def test_tool_call_structure_tier():
    a = chat(None, [_call("get_weather", '{"city": "Paris"}')], finish="tool_calls")
    assert compare_answers(SAMPLED, a, chat(None, [_call("get_weather", '{"city": "Rome"}')], "tool_calls")).diffs == []
    got = compare_answers(SAMPLED, a, chat(None, [_call("get_time", '{"city": "Paris"}')], "tool_calls"))
    assert tiers(got) == ["tool_calls"]
    assert tiers(compare_answers(SAMPLED, a, chat(None, [_call("get_weather", '{"city": ')], "tool_calls"))) == [
        "tool_calls"]
    assert [d.detail for d in compare_answers(SAMPLED, a, chat(None, [], "tool_calls")).diffs] == [
        "choice 0: 1 vs 0 tool calls"]


def test_streamed_tool_calls_merge_by_index():
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": [
        {"index": 0, "id": "c", "function": {"name": "f", "arguments": '{"x"'}}]}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
                      "finish_reason": "tool_calls"}]}]
    cap = Capture(status=200, stream=True, events=events, done=True)
    whole = chat(None, [_call("f", '{"x": 1}')], finish="tool_calls")
    assert tiers(compare_answers(SAMPLED, cap, whole)) == ["usage"]  # usage only present on one side


def test_noise_baseline_subtracts_tiers_the_primary_disagrees_with_itself_on():
    # request 0: the primary varies its chunking run to run; the candidate differs there too -> noise
    # request 1: the primary is stable; the candidate's text differs -> a real divergence
    # request 2: no difference anywhere
    primary = [stream(["Hel", "lo"]), completion("abc"), completion("x")]
    primary_again = [stream(["Hello"], usage=True), completion("abc"), completion("x")]
    candidate = [stream(["H", "el", "lo"]), completion("abd"), completion("x")]
    signal = [compare_answers(SAMPLED, p, c) for p, c in zip(primary, candidate, strict=True)]
    noise = [compare_answers(SAMPLED, p, q) for p, q in zip(primary, primary_again, strict=True)]
    signal[1] = compare_answers(GREEDY, primary[1], candidate[1])
    report = divergence_report(signal, noise)
    assert report["diverged_rate"] == pytest.approx(2 / 3)
    assert report["noise_rate"] == pytest.approx(1 / 3)
    assert report["diverged_beyond_noise_rate"] == pytest.approx(1 / 3)
    assert report["tiers"]["stream_shape"] == {"divergence_rate": pytest.approx(1 / 3),
                                               "noise_rate": pytest.approx(1 / 3), "beyond_noise_rate": 0.0}
    assert report["tiers"]["text"]["beyond_noise_rate"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="2 candidate comparisons but 3"):
        divergence_report(signal[:2], noise)


def test_builtin_regression_set_sizes_long_inputs_from_the_limits(tmp_path):
    from tandem.gateway.regression import FILLER, builtin_cases, load_cases

    cases = {c.name: c for c in builtin_cases(256, 8.0, largest_model_len=512)}
    assert len(cases["long_input_near_limit"].body["prompt"]) == len(FILLER) * (int(240 / 8) - 2)
    assert len(cases["fail_input_over_limit"].body["prompt"]) == len(FILLER) * (int(768 / 8) + 1)
    assert cases["fail_input_over_limit"].expect_status == 400 and cases["fail_unknown_model"].expect_status == 404
    assert "long_input_near_limit" not in {c.name for c in builtin_cases(None, None)}
    assert cases["streaming_split"].same_text_as == "stop_length"
    path = tmp_path / "cases.jsonl"
    path.write_text('{"prompt": "hi"}\n\n{"name": "c", "messages": [{"role": "user", "content": "x"}]}\n')
    loaded = load_cases(str(path))
    assert [(c.name, c.endpoint, c.body["max_tokens"]) for c in loaded] == [
        ("line1", "completions", 16), ("c", "chat/completions", 16)]
    path.write_text('{"oops": 1}\n')
    with pytest.raises(ValueError, match="needs body, prompt or messages"):
        load_cases(str(path))
