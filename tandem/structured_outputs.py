"""Structured-output constraints -> llguidance grammar text, and the edge's check (no torch here).

``grammar_text`` turns a ``StructuredOutputsParams`` into an llguidance grammar; ``check_grammar``
refuses (400) one the engine cannot honour, naming the keyword: llguidance reports unimplemented
JSON-schema keywords (``uniqueItems``, ``contains``, ``not``, ``dependentRequired``, ...) instead of
ignoring them, and Tandem never sets its ``lenient`` option, so nothing is silently relaxed.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import llguidance

from tandem.sampling_params import SamplingParamsError, StructuredOutputsParams

# NOTE: between JSON tokens: one space, or a newline and an indentation of up to 16 spaces or tabs.
# Pretty-printed JSON fits; unbounded whitespace (JSON's own rule) lets a weak model pad forever.
JSON_WHITESPACE = r"(?:\n[ \t]{0,16}| )?"


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON text) of one constraint; deterministic, so it is the cache key.

    Raises:
        SamplingParamsError: ``json`` is a string that is not a JSON object, or a grammar that is
            neither Lark nor GBNF (param ``structured_outputs.<kind>``).
    """
    kind = params.kind
    options: dict[str, Any] = {"whitespace_flexible": False}
    if not params.disable_any_whitespace:
        options = {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE}
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
        if kind == "json":
            schema = json.loads(params.json) if isinstance(params.json, str) else params.json
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", params.choice)
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as e:  # NOTE: json.JSONDecodeError is a ValueError
        raise SamplingParamsError(f"invalid structured_outputs.{kind}: {e}", f"structured_outputs.{kind}") from None


def check_grammar(params: StructuredOutputsParams, tokenizer: Any = None,
                  param: str = "structured_outputs") -> str:
    """The grammar text of ``params`` once llguidance accepted it (with ``tokenizer`` when given).

    Raises:
        SamplingParamsError: the schema uses a keyword llguidance does not implement (the message
            names it, e.g. ``Unimplemented keys: ["uniqueItems"]``), or the regex / grammar / schema
            is invalid; ``param`` is the request field to name.
    """
    text = grammar_text(params)
    error = _grammar_error(text) if tokenizer is None else _validate(text, tokenizer)
    if error is not None:
        what = "JSON schema" if params.kind == "json" else params.kind
        raise SamplingParamsError(f"the {what} cannot be enforced: {error}", param)
    return text


def _validate(text: str, tokenizer: Any) -> str | None:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
    return messages[0] if is_error else None


@lru_cache(maxsize=1024)
def _grammar_error(text: str) -> str | None:
    """llguidance's error for a grammar (None: valid); cached, clients resend the same schemas."""
    return _validate(text, None)
