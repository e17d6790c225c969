"""An OpenAI answer (completions or chat; whole or streamed) reduced to what the comparator reads.

Streams are merged per choice `index` as the OpenAI streaming spec defines: completion `text` and
chat `delta.content` concatenate, chat `delta.tool_calls` merge by their `index` (the name arrives
once, `arguments` in pieces), logprobs extend. Token strings come from completions' `logprobs.tokens`
/ `top_logprobs` (dicts token -> logprob) or chat's `logprobs.content[].token` / `.top_logprobs[]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.gateway.capture import Capture


@dataclass
class Answer:
    """texts/finish/tool_calls per choice index; tokens/top per choice per position (None when the
    answer had no logprobs); role_chunk: a chat stream's role header was seen."""

    status: int | None
    error_type: str | None = None
    error_code: str | None = None
    texts: list[str] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    tokens: list[list[str]] | None = None
    top: list[list[set[str]]] | None = None
    usage: dict[str, Any] | None = None
    tool_calls: list[list[dict[str, Any]]] = field(default_factory=list)
    stream: bool = False
    role_chunk: bool = False
    chunks: int = 0
    done: bool = False


class _Choice:
    def __init__(self) -> None:
        self.text: list[str] = []
        self.finish: str | None = None
        self.tokens: list[str] = []
        self.top: list[set[str]] = []
        self.has_logprobs = False
        self.tools: dict[int, dict[str, Any]] = {}

    def add_logprobs(self, lp: Any) -> None:
        if not isinstance(lp, dict):
            return
        self.has_logprobs = True
        if isinstance(lp.get("content"), list):  # chat
            for item in lp["content"]:
                self.tokens.append(item.get("token", ""))
                self.top.append({t.get("token", "") for t in item.get("top_logprobs") or []})
        else:  # completions
            self.tokens.extend(lp.get("tokens") or [])
            self.top.extend(set(d or {}) for d in lp.get("top_logprobs") or [])

    def add_tools(self, calls: Any) -> None:
        for n, call in enumerate(calls or []):
            slot = self.tools.setdefault(call.get("index", n), {"name": "", "arguments": ""})
            fn = call.get("function") or {}
            slot["name"] = fn.get("name") or slot["name"]
            slot["arguments"] += fn.get("arguments") or ""

    def add(self, choice: dict[str, Any], part: dict[str, Any]) -> None:
        self.text.append(part.get("content") or choice.get("text") or "")
        self.finish = choice.get("finish_reason") or self.finish
        self.add_logprobs(choice.get("logprobs"))
        self.add_tools(part.get("tool_calls"))


def _merge(answer: Answer, choices: dict[int, _Choice]) -> Answer:
    ordered = [choices[k] for k in sorted(choices)]
    answer.texts = ["".join(c.text) for c in ordered]
    answer.finish = [c.finish for c in ordered]
    answer.tool_calls = [[c.tools[k] for k in sorted(c.tools)] for c in ordered]
    if ordered and all(c.has_logprobs for c in ordered):
        answer.tokens = [c.tokens for c in ordered]
        answer.top = [c.top for c in ordered]
    return answer


def answer_of(capture: Capture) -> Answer:
    """The Answer of one Capture (a stream's events must have been kept)."""
    answer = Answer(status=capture.status, usage=capture.usage, stream=capture.stream, done=capture.done)
    if capture.status != 200:
        err = capture.body.get("error") if isinstance(capture.body, dict) else None
        if isinstance(err, dict):
            answer.error_type, answer.error_code = err.get("type"), err.get("code")
        return answer
    choices: dict[int, _Choice] = {}
    if capture.stream:
        for event in capture.events:
            for choice in event.get("choices") or []:
                answer.chunks += 1
                delta = choice.get("delta") or {}
                answer.role_chunk = answer.role_chunk or "role" in delta
                choices.setdefault(choice.get("index", 0), _Choice()).add(choice, delta)
    elif isinstance(capture.body, dict):
        for choice in capture.body.get("choices") or []:
            message = choice.get("message") or {}
            choices.setdefault(choice.get("index", 0), _Choice()).add(choice, message)
    return _merge(answer, choices)
