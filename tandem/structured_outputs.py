"""Structured-output constraints -> llguidance grammar text, and the edge's check (no torch here).

``grammar_text`` turns a ``StructuredOutputsParams`` into an llguidance grammar; ``check_grammar``
refuses (400) one the engine cannot honour, naming the keyword: llguidance reports unimplemented
JSON-schema keywords (``uniqueItems``, ``contains``, ``not``, ``dependentRequired``, ...) instead of
ignoring them, and Tandem never sets its ``lenient`` option, so nothing is silently relaxed. A regex
or grammar that matches no text at all (``[^\\s\\S]``, ``[a&&b]``) is refused too: llguidance
reports an empty JSON schema itself, and for the others the check builds the grammar over a byte
vocabulary and looks at its first mask (nothing but end-of-text allowed, and the empty text not in
the language). Regexes (``regex`` and JSON-schema ``pattern``) follow ECMAScript's classes, as JSON
Schema and xgrammar define them: ``\\d`` is ``[0-9]`` and ``\\w`` is ``[A-Za-z0-9_]`` (llguidance's
Rust regexes would take every Unicode digit and letter); ``\\s`` stays Unicode whitespace (as in
ECMAScript). Regexes inside a Lark ``grammar`` are passed as written (Rust syntax).
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
# NOTE: the check runs on the API server's event loop and llguidance's check grows faster than the
# grammar: 10,000 choices (209 KB) 0.26 s, 20,000 (429 KB) 0.7 s, a 500 KB schema 3.5 s here. Larger
# grammars are refused rather than let one request stall every other.
MAX_GRAMMAR_BYTES = 256 * 1024


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON text) of one constraint; deterministic, so it is the cache key.

    Raises:
        SamplingParamsError: ``json`` is a string that is not a JSON object, a schema nested too deeply
            (Python's recursion limit), or a grammar that is neither Lark nor GBNF (param
            ``structured_outputs.<kind>``).
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
            return llguidance.LLMatcher.grammar_from_json_schema(ecmascript_patterns(schema), defaults=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(ecmascript_classes(params.regex))
        if kind == "choice":
            return llguidance.grammar_from("choice", params.choice)
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as e:  # NOTE: json.JSONDecodeError is a ValueError
        raise SamplingParamsError(f"invalid structured_outputs.{kind}: {e}", f"structured_outputs.{kind}") from None
    except RecursionError:  # NOTE: json.loads and ecmascript_patterns recurse once per nesting level
        raise SamplingParamsError(f"invalid structured_outputs.{kind}: nested too deeply",
                                  f"structured_outputs.{kind}") from None


# ECMAScript's (JSON Schema's) meaning of the class escapes that Rust regexes read as Unicode classes;
# Rust's regex syntax nests classes, so the replacement is valid inside ``[...]`` too.
_ECMASCRIPT_CLASSES = {"d": "[0-9]", "D": "[^0-9]", "w": "[A-Za-z0-9_]", "W": "[^A-Za-z0-9_]"}
_NOT_SCHEMAS = frozenset({"const", "enum", "default", "examples"})  # keywords whose values are data
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "dependentSchemas"})  # name -> schema


def ecmascript_classes(regex: str) -> str:
    """``regex`` with ``\\d``, ``\\D``, ``\\w``, ``\\W`` replaced by their ASCII classes (ECMA-262
    section 22.2.2.9); other escapes, including ``\\\\d`` (a backslash, then ``d``), are kept."""
    out, i = [], 0
    while i < len(regex):
        if regex[i] == "\\" and i + 1 < len(regex):
            pair = regex[i + 1]
            out.append(_ECMASCRIPT_CLASSES.get(pair, "\\" + pair))
            i += 2
        else:
            out.append(regex[i])
            i += 1
    return "".join(out)


def ecmascript_patterns(schema: Any) -> Any:
    """A copy of a JSON schema whose ``pattern`` and ``patternProperties`` regexes use ECMAScript's
    classes (``ecmascript_classes``); ``const``, ``enum``, ``default`` and ``examples`` values are data
    and stay as given."""
    if isinstance(schema, list):
        return [ecmascript_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _NOT_SCHEMAS:
            out[key] = value
        elif key == "pattern" and isinstance(value, str):
            out[key] = ecmascript_classes(value)
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {ecmascript_classes(k): ecmascript_patterns(v) for k, v in value.items()}
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: ecmascript_patterns(v) for k, v in value.items()}  # NOTE: keys are names
        else:
            out[key] = ecmascript_patterns(value)
    return out


def check_grammar(params: StructuredOutputsParams, tokenizer: Any = None,
                  param: str = "structured_outputs") -> str:
    """The grammar text of ``params`` once llguidance accepted it (with ``tokenizer`` when given).

    Raises:
        SamplingParamsError: the schema uses a keyword llguidance does not implement (the message
            names it, e.g. ``Unimplemented keys: ["uniqueItems"]``), the regex / grammar / schema is
            invalid, matches no text, or its grammar text exceeds ``MAX_GRAMMAR_BYTES``; ``param`` is
            the request field to name.
    """
    text = grammar_text(params)
    if len(text) > MAX_GRAMMAR_BYTES:
        error = f"its grammar is {len(text)} bytes, more than the {MAX_GRAMMAR_BYTES} this server compiles"
    else:
        error = _grammar_error(text) if tokenizer is None else _validate(text, tokenizer)
    if error is None and params.kind in ("regex", "grammar") and _matches_nothing(text):
        error = "it matches no text"
    if error is not None:
        what = "JSON schema" if params.kind == "json" else params.kind
        if params.kind == "regex":
            what = f"regex {params.regex!r}"
        raise SamplingParamsError(f"the {what} cannot be enforced: {error}", param)
    return text


def _validate(text: str, tokenizer: Any) -> str | None:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
    return messages[0] if is_error else None


@lru_cache(maxsize=1024)
def _grammar_error(text: str) -> str | None:
    """llguidance's error for a grammar (None: valid); cached, clients resend the same schemas."""
    return _validate(text, None)


class _ByteVocabulary:
    """A vocabulary of the 256 bytes plus an end-of-text token (id 256), for llguidance's
    ``TokenizerWrapper``: grammars built over it show, model-free, which bytes may start the text."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


@lru_cache(maxsize=1)
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()), slices=[])


@lru_cache(maxsize=1024)
def _matches_nothing(text: str) -> bool:
    """True if no text (not even the empty one) can satisfy the grammar, as far as its first mask
    shows: no byte may start it and it does not accept the empty text. A grammar that dies later (a
    Lark rule ``"a" /[^\\s\\S]/``) is not detected; it ends its request at that point."""
    matcher = llguidance.LLMatcher(_byte_tokenizer(), text, log_level=0)
    if matcher.is_error():
        return False  # NOTE: reported by _grammar_error with llguidance's message
    allowed = matcher.compute_logit_bias()
    return not any(allowed[:256]) and not matcher.is_accepting()
