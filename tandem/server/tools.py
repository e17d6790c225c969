"""Tool calling on ``/v1/chat/completions``, with vLLM's semantics and flags.

``tool_choice``: absent means "auto" when ``tools`` are given, else "none" (vLLM). "none": tools are
rendered by the chat template, the output is plain text. "auto": needs ``--enable-auto-tool-choice``
and ``--tool-call-parser`` (else 400, vLLM's message); the parser finds calls in the free text.
"required" and a named function: the output is constrained by a grammar (structured output), so the
arguments always parse against the tool's JSON schema: a named choice generates the arguments object
itself (vLLM's named function calling), "required" a JSON array of ``{"name", "parameters"}`` items
(at most one with ``parallel_tool_calls: false``). Under "auto", ``parallel_tool_calls: false`` keeps
the first call the parser found and drops the rest (vLLM's rule since its PR 26233; generation is not
cut short), and a call to a function that is not in ``tools`` is returned as the model wrote it, as
vLLM's parsers do: the client decides what an unknown name means. Every tool's ``parameters`` must be
a valid JSON Schema (checked with ``jsonschema`` whatever the choice; a 400 names the tool).
``finish_reason`` is "tool_calls" when auto or required produced calls, "stop" for a named choice
(as OpenAI and vLLM answer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from tandem.sampling_params import SamplingParamsError, StructuredOutputsParams
from tandem.server.tool_parsers import TOOL_PARSERS, ToolCall, ToolParser, make_call

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses tools: ``mode`` "none" | "auto" | "required" | "named" (``name`` set)."""

    mode: str = "none"
    name: str | None = None
    constraint: StructuredOutputsParams | None = None
    parser: ToolParser | None = None
    parallel: bool = True  # False: at most one call (``parallel_tool_calls: false``)

    @property
    def parses_calls(self) -> bool:
        return self.mode != "none"


def _tool_schema(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if params else {"type": "object", "properties": {}}


def check_tool_schemas(tools: list[dict[str, Any]]) -> None:
    """Raises: SamplingParamsError if a tool's ``parameters`` is not a valid JSON Schema (checked
    against the metaschema of its ``$schema``, draft 2020-12 by default); the message names the tool."""
    for i, tool in enumerate(tools):
        schema = tool["function"].get("parameters")
        if schema is None:
            continue
        try:
            jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
        except jsonschema.SchemaError as e:
            raise SamplingParamsError(f"the parameters of tool {tool['function']['name']!r} are not a valid JSON "
                                      f"Schema: {e.message}", f"tools.{i}.function.parameters") from None


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of a "required" output: a non-empty array of calls to the given tools."""
    items = [{"type": "object", "properties": {"name": {"enum": [t["function"]["name"]]},
                                                "parameters": _tool_schema(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


@dataclass
class ToolCalling:
    """The server's tool-calling settings (``--enable-auto-tool-choice``, ``--tool-call-parser``)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    _parser: ToolParser | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            if self.tool_call_parser not in TOOL_PARSERS:
                raise ValueError(f"unknown --tool-call-parser {self.tool_call_parser!r}; choose from "
                                 f"{', '.join(TOOL_PARSERS)}")
            self._parser = TOOL_PARSERS[self.tool_call_parser]()
        if self.enable_auto_tool_choice and self._parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")

    def plan(self, tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None) -> ToolPlan:
        """The request's ``ToolPlan``.

        Raises:
            SamplingParamsError: a ``tool_choice`` without tools, an unknown choice or function name,
                "auto" without the server flags, a tool's ``parameters`` that is not a JSON Schema
                (param ``tool_choice`` or ``tools...``). Whether the grammar engine can honour the
                plan's ``constraint`` is the caller's check (param ``tools``), off the event loop.
        """
        if not tools:
            if tool_choice not in (None, "none"):
                raise SamplingParamsError("When using `tool_choice`, `tools` must be set.", "tool_choice")
            return ToolPlan()
        check_tool_schemas(tools)
        choice = "auto" if tool_choice is None else tool_choice
        if choice == "none":
            return ToolPlan()
        if choice == "auto":
            if not self.enable_auto_tool_choice:
                raise SamplingParamsError(AUTO_NEEDS_FLAGS, "tool_choice")
            return ToolPlan("auto", parser=self._parser, parallel=parallel is not False)
        if choice == "required":
            constraint = StructuredOutputsParams(json=required_schema(tools, parallel is not False))
            return ToolPlan("required", constraint=constraint)
        name = _named_choice(choice)
        matches = [t for t in tools if t["function"]["name"] == name]
        if not matches:
            raise SamplingParamsError(f"tool_choice names the function {name!r}, which is not in tools",
                                      "tool_choice")
        constraint = StructuredOutputsParams(json=_tool_schema(matches[0]))
        return ToolPlan("named", name=name, constraint=constraint)


def _named_choice(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(function, dict)
            and isinstance(function.get("name"), str)):
        raise SamplingParamsError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                  '"function": {"name": ...}}', "tool_choice")
    return function["name"]


def extract_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output under ``plan``; malformed output is returned as content."""
    if plan.mode == "none":
        return text, []
    try:
        if plan.mode == "named":
            return None, [make_call(plan.name, text)]
        if plan.mode == "required":
            items = json.loads(text)
            return None, [make_call(item["name"], item["parameters"]) for item in items]
    except (ValueError, TypeError, KeyError, RecursionError):
        return text, []
    assert plan.parser is not None
    content, calls = plan.parser.parse(text)
    return content, calls if plan.parallel else calls[:1]


def finish_reason(plan: ToolPlan, calls: list[Any], reason: str | None) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when auto / required produced calls and the output ended."""
    if calls and reason == "stop" and plan.mode in ("auto", "required"):
        return "tool_calls"
    return reason


class ToolCallStream:
    """Splits one streamed choice: content before a possible call goes out at once; from where a call
    may start (``ToolParser.call_start``, or the first token under a grammar) the text is held until
    the output ends, then parsed into calls (or sent as content when it is not a clean call)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of ``text`` already sent as content

    def feed(self, delta: str) -> str:
        """Adds new text; returns the part that can be sent as content now."""
        self.text += delta
        if self.plan.mode == "none":
            out, self.sent = self.text[self.sent:], len(self.text)
            return out
        if self.plan.mode in ("named", "required"):
            return ""
        assert self.plan.parser is not None
        start = self.plan.parser.call_start(self.text)
        limit = len(self.text) if start is None else start
        if limit <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:limit], limit
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content still to send, OpenAI ``delta.tool_calls`` entries) once the output ended."""
        if self.plan.mode == "none":
            return "", []
        content, calls = extract_calls(self.plan, self.text)
        if not calls:
            return self.text[self.sent:], []
        entries = [{"index": i, **call.to_openai()} for i, call in enumerate(calls)]
        sent_text = self.text[: self.sent].strip()
        rest = (content or "")[len(sent_text):] if content and content.startswith(sent_text) else ""
        return rest, entries

