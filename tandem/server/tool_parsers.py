"""Tool-call parsers: a model's text -> (content, tool calls), one per output format, named as vLLM's
``--tool-call-parser`` values.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (NousResearch Hermes
  2 Pro, Qwen2.5 and many fine-tunes); text before the first block is the content.
- ``llama3_json``: the whole output is ``{"name": ..., "parameters": {...}}`` objects, optionally
  after ``<|python_tag|>`` and separated by ``;`` (Llama 3.1/3.2 JSON tool calling).
- ``pythonic``: the whole output is a Python list of calls, ``[f(a=1), g(b="x")]`` (Llama 3.2/4).

A malformed call never raises: the output is returned as plain content with no calls. Each parser
also says where a call may start (``call_start``), so a stream can send the content before it and
hold back the rest until the output is complete.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON text (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = ""

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def make_call(name: Any, arguments: Any) -> ToolCall:
    """A ``ToolCall`` from decoded values. Raises ValueError: the name is not a string or the arguments
    are neither a JSON object nor a JSON text of one."""
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        raise ValueError("a tool call needs a string name and an object of arguments")
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False), new_call_id())


class ToolParser:
    """The interface: ``parse`` a complete output; ``call_start`` finds where calls may begin."""

    name = ""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None, calls); on any malformed call: (the whole text, [])."""
        raise NotImplementedError

    def call_start(self, text: str) -> int | None:
        """Index in ``text`` (a prefix of the output) from which it may be a call, else None."""
        raise NotImplementedError


def _partial_marker_start(text: str, marker: str) -> int | None:
    """Where ``marker`` starts in ``text``, or where a suffix of ``text`` could be its beginning."""
    at = text.find(marker)
    if at >= 0:
        return at
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return None


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        try:
            calls = []
            for body in self._BLOCK.findall(text[start:]):
                value = json.loads(body.strip())
                if not isinstance(value, dict):
                    raise ValueError("a tool call must be a JSON object")
                calls.append(make_call(value.get("name"), value.get("arguments", {})))
        except (ValueError, RecursionError):  # NOTE: RecursionError: JSON nested too deeply
            return text, []
        rest = self._BLOCK.sub("", text[start:]).strip()
        if rest:  # NOTE: text between or after the blocks: not a clean call, keep it all as content
            return text, []
        content = text[:start].strip()
        return content or None, calls

    def call_start(self, text: str) -> int | None:
        return _partial_marker_start(text, self.START)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        body = body.removeprefix(self.TAG).lstrip()
        if not body.startswith("{"):
            return text, []
        decoder = json.JSONDecoder()
        calls, at = [], 0
        try:
            while at < len(body):
                value, end = decoder.raw_decode(body, at)
                if not isinstance(value, dict):
                    raise ValueError("a tool call must be a JSON object")
                calls.append(make_call(value.get("name"), value.get("parameters", value.get("arguments", {}))))
                at = end
                while at < len(body) and body[at] in " \t\r\n;":
                    at += 1
        except (ValueError, RecursionError):  # NOTE: RecursionError: JSON nested too deeply
            return text, []
        return None, calls

    def call_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if not stripped:
            return 0  # NOTE: nothing but whitespace yet: the output may still open with a call
        if stripped.startswith("{") or self.TAG.startswith(stripped[: len(self.TAG)]):
            return len(text) - len(stripped)
        return None


class PythonicParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if not body.startswith("["):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                raise ValueError("not a list of calls")
            calls = []
            for node in tree.elts:
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                    raise ValueError("each element must be name(keyword=value, ...)")
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
                if len(args) != len(node.keywords):
                    raise ValueError("**kwargs are not allowed")
                calls.append(make_call(node.func.id, args))
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            return text, []
        return None, calls

    def call_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        return len(text) - len(stripped) if not stripped or stripped.startswith("[") else None


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, PythonicParser)}
