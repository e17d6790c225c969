"""The built-in regression set of `tandem compare`, and user cases from a JSONL file.

Each case is one OpenAI request (the `model` is filled in per server). `expect_status` marks a
request that must fail with that status on both servers. `same_text_as` names a case whose text
this one must reproduce on the same server (a stream against the whole answer: the streaming split).
The long-input cases are sized from the context limit (`max_model_len`) and the tokens per
repetition of a filler measured with the server's `/tokenize` when it has one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

FILLER = "the cat sat on the mat. "
_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                         "required": ["city"]}}}
_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


@dataclass(frozen=True)
class Case:
    """name: unique; endpoint: `completions` or `chat/completions`; body: the request without
    `model` (unless `keep_model`); expect_status: the status both servers must answer, if any;
    refusal_ok: a 4xx refusal is a valid answer too (empty input: some servers answer it, Tandem
    refuses it), so two refusals are compared rather than reported as not run."""

    name: str
    endpoint: str
    body: dict[str, Any]
    expect_status: int | None = None
    same_text_as: str | None = None
    keep_model: bool = False
    raw_body: bytes | None = None
    notes: str = ""
    refusal_ok: bool = False

    def request(self, model: str) -> dict[str, Any]:
        return dict(self.body) if self.keep_model else {"model": model, **self.body}


def _chat(content: str, **kw: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], **kw}


def builtin_cases(max_model_len: int | None, tokens_per_filler: float | None,
                  largest_model_len: int | None = None) -> list[Case]:
    """The built-in set; the long-input cases only when the context limit is known. max_model_len:
    the smaller side's limit (the near-limit input must fit both); largest_model_len: the larger
    one (the over-limit input must exceed both; default max_model_len)."""
    greedy = {"temperature": 0, "max_tokens": 8}
    cases = [
        Case("stop_length", "completions", {"prompt": "Once upon a time", **greedy}),
        Case("stop_eos_or_length", "completions", {"prompt": "The end.", "temperature": 0, "max_tokens": 48}),
        Case("stop_string", "completions", {"prompt": "Once upon a time", "temperature": 0, "max_tokens": 32,
                                            "stop": [" the", "."]}),
        Case("streaming_split", "completions", {"prompt": "Once upon a time", **greedy, "stream": True,
                                                "stream_options": {"include_usage": True}},
             same_text_as="stop_length"),
        Case("chat", "chat/completions", _chat("Tell me a story.", **greedy)),
        Case("chat_stream", "chat/completions", _chat("Tell me a story.", **greedy, stream=True),
             same_text_as="chat"),
        Case("tool_call", "chat/completions", _chat("What is the weather in Paris?", tools=[_TOOL],
                                                     tool_choice="auto", **greedy)),
        Case("json_object", "chat/completions", _chat("Answer in JSON.", response_format={"type": "json_object"},
                                                       **greedy)),
        Case("json_schema", "chat/completions", _chat("Answer in JSON.", response_format={
            "type": "json_schema", "json_schema": {"name": "answer", "schema": _SCHEMA}}, **greedy)),
        Case("empty_prompt", "completions", {"prompt": "", **greedy}, refusal_ok=True),
        Case("unicode", "completions", {"prompt": "Café 東京 🚀 naïve — «ok»", **greedy, "stream": True}),
        Case("n2_seeded", "completions", {"prompt": "Once upon a time", "n": 2, "seed": 1234, "temperature": 0.8,
                                          "max_tokens": 8}),
        Case("logprobs", "completions", {"prompt": "Once upon a time", **greedy, "logprobs": 3}),
        Case("chat_logprobs", "chat/completions", _chat("Tell me a story.", **greedy, logprobs=True, top_logprobs=3)),
        Case("fail_unknown_model", "completions", {"model": "no-such-model", "prompt": "x", "max_tokens": 1},
             expect_status=404, keep_model=True),
        Case("fail_negative_max_tokens", "completions", {"prompt": "x", "max_tokens": -1}, expect_status=400),
        Case("fail_bad_temperature", "completions", {"prompt": "x", "max_tokens": 1, "temperature": -1},
             expect_status=400),
        Case("fail_missing_messages", "chat/completions", {"max_tokens": 1}, expect_status=400),
        Case("fail_malformed_json", "completions", {}, expect_status=400, raw_body=b'{"prompt": "x",'),
    ]
    if max_model_len and tokens_per_filler:
        fit = int((max_model_len - 16) / tokens_per_filler)
        cases.append(Case("long_input_near_limit", "completions",
                          {"prompt": FILLER * max(1, fit - 2), "temperature": 0, "max_tokens": 4},
                          notes=f"about {max_model_len - 16} of {max_model_len} tokens"))
        largest = max(largest_model_len or 0, max_model_len)
        over = int(largest * 1.5 / tokens_per_filler) + 1
        cases.append(Case("fail_input_over_limit", "completions", {"prompt": FILLER * over, "max_tokens": 4},
                          expect_status=400, notes=f"about {int(largest * 1.5)} tokens"))
    return cases


def load_cases(path: str) -> list[Case]:
    """Cases from a JSONL file: per line `{"name", "endpoint", "body", "expect_status"}` or just
    `{"prompt": ...}` / `{"messages": [...]}` (greedy, 16 tokens). Raises ValueError on a bad line."""
    cases = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not JSON: {e}") from e
            if not isinstance(item, dict):
                raise ValueError(f"{path}:{n}: expected an object")
            name, endpoint = item.pop("name", f"line{n}"), item.pop("endpoint", None)
            status = item.pop("expect_status", None)
            if not isinstance(name, str) or not (status is None or isinstance(status, int)):
                raise ValueError(f"{path}:{n}: name must be a string and expect_status an integer")
            if endpoint not in (None, "completions", "chat/completions"):
                raise ValueError(f"{path}:{n}: endpoint must be completions or chat/completions, got {endpoint!r}")
            if "body" in item:
                if not isinstance(item["body"], dict):
                    raise ValueError(f"{path}:{n}: body must be a JSON object, got {type(item['body']).__name__}")
                cases.append(Case(name, endpoint or "completions", item["body"], status))
            elif "messages" in item or "prompt" in item:
                endpoint = endpoint or ("chat/completions" if "messages" in item else "completions")
                cases.append(Case(name, endpoint, {"temperature": 0, "max_tokens": 16, **item}, status))
            else:
                raise ValueError(f"{path}:{n}: needs body, prompt or messages")
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: case names must be unique")
    return [Case(c.name, c.endpoint, {k: v for k, v in c.body.items() if k != "name"}, c.expect_status)
            for c in cases]
