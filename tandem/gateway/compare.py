"""Tiered comparison of two OpenAI-compatible answers to the same request, and a noise baseline.

Tiers, each a `Diff.tier` name:
- `status`: HTTP status; `error_body`: both failed, with a different error `type` or `code`;
- `text`: exact text per choice, only for deterministic requests (temperature 0 or a seed);
  `near_tie` instead when, at the first differing token, each side's token is among the other
  side's top-k logprobs (AMD PACE's correctness harness rule) — a soft difference, not a divergence;
- `finish_reason`, `usage` (prompt tokens; completion tokens for deterministic requests);
- `stream_shape`: the chat role chunk, the number of choice chunks, `[DONE]`;
- `json`: validity of JSON answers (response_format json_object / json_schema, or both texts JSON),
  the schema (jsonschema) when one was given, and the shape (keys and value types);
- `tool_calls`: count, function names, argument JSON validity and keys.
Noise (Diffy, Twitter 2015): the same request is sent to the primary twice; a difference between
the primary and the candidate in a tier where the primary also differed from itself on that request
is noise, not a divergence, and each tier's divergence rate is reported beside its noise rate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from tandem.gateway.answer import Answer, answer_of
from tandem.gateway.capture import Capture

HARD_TIERS = ("status", "error_body", "text", "finish_reason", "usage", "stream_shape", "json", "tool_calls")
SOFT_TIERS = ("near_tie",)


@dataclass(frozen=True)
class Diff:
    """One difference: its tier and a short human description (no prompt or answer text)."""

    tier: str
    detail: str


@dataclass
class Comparison:
    """All differences of one pair. diverged: some hard-tier difference remains."""

    diffs: list[Diff] = field(default_factory=list)

    @property
    def tiers(self) -> set[str]:
        return {d.tier for d in self.diffs}

    @property
    def diverged(self) -> bool:
        return any(d.tier in HARD_TIERS for d in self.diffs)

    def without(self, tiers: set[str]) -> Comparison:
        """A copy without the differences in `tiers` (noise subtraction)."""
        return Comparison([d for d in self.diffs if d.tier not in tiers])


def is_deterministic(request: dict[str, Any]) -> bool:
    """Greedy (temperature 0) or seeded requests, whose text two correct servers should agree on."""
    return request.get("temperature") == 0 or request.get("seed") is not None


def first_divergence(a: list[str], b: list[str]) -> int | None:
    """Index of the first position where two token lists differ (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _near_tie(a: Answer, b: Answer, i: int) -> str | None:
    """Describes a near tie at choice i's first differing token, or None when it is not one."""
    if not (a.tokens and b.tokens and a.top and b.top and i < len(a.tokens) and i < len(b.tokens)):
        return None
    pos = first_divergence(a.tokens[i], b.tokens[i])
    if pos is None or pos >= min(len(a.tokens[i]), len(b.tokens[i])):
        return None
    if pos >= min(len(a.top[i]), len(b.top[i])):
        return None
    ta, tb = a.tokens[i][pos], b.tokens[i][pos]
    if ta in b.top[i][pos] and tb in a.top[i][pos]:
        return f"choice {i}: first difference at token {pos}, each side's token in the other's top-k"
    return None


def _compare_text(request: dict[str, Any], a: Answer, b: Answer, out: list[Diff]) -> None:
    if not is_deterministic(request):
        return
    if len(a.texts) != len(b.texts):
        out.append(Diff("text", f"{len(a.texts)} vs {len(b.texts)} choices"))
    for i, (x, y) in enumerate(zip(a.texts, b.texts, strict=False)):
        if x == y:
            continue
        tie = _near_tie(a, b, i)
        if tie:
            out.append(Diff("near_tie", tie))
        else:
            pos = next((k for k, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
            out.append(Diff("text", f"choice {i}: texts differ from character {pos} (lengths {len(x)} vs {len(y)})"))


def _compare_usage(request: dict[str, Any], a: Answer, b: Answer, out: list[Diff]) -> None:
    if a.usage is None or b.usage is None:
        if (a.usage is None) != (b.usage is None):
            out.append(Diff("usage", f"usage present: {a.usage is not None} vs {b.usage is not None}"))
        return
    keys = ["prompt_tokens"] + (["completion_tokens"] if is_deterministic(request) else [])
    for key in keys:
        if a.usage.get(key) != b.usage.get(key):
            out.append(Diff("usage", f"{key} {a.usage.get(key)} vs {b.usage.get(key)}"))


def _compare_stream(a: Answer, b: Answer, out: list[Diff]) -> None:
    if not (a.stream and b.stream):
        return
    if a.role_chunk != b.role_chunk:
        out.append(Diff("stream_shape", f"role chunk {a.role_chunk} vs {b.role_chunk}"))
    if a.done != b.done:
        out.append(Diff("stream_shape", f"[DONE] {a.done} vs {b.done}"))
    if a.chunks != b.chunks:
        out.append(Diff("stream_shape", f"choice chunks {a.chunks} vs {b.chunks}"))


def json_shape(value: Any) -> Any:
    """The structure of a JSON value: dict keys with their shapes, a list's first item's shape,
    and type names for scalars (int and float are both `number`)."""
    if isinstance(value, dict):
        return {k: json_shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [json_shape(value[0])] if value else []
    if isinstance(value, bool) or value is None:
        return type(value).__name__
    return "number" if isinstance(value, int | float) else "string"


def _parse_json(text: str) -> tuple[bool, Any]:
    try:
        return True, json.loads(text)
    except ValueError:
        return False, None


def _compare_json(request: dict[str, Any], a: Answer, b: Answer, out: list[Diff]) -> None:
    fmt = request.get("response_format") or {}
    wants_json = isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema")
    schema = ((fmt.get("json_schema") or {}).get("schema")) if wants_json else None
    for i, (x, y) in enumerate(zip(a.texts, b.texts, strict=False)):
        (ok_a, va), (ok_b, vb) = _parse_json(x), _parse_json(y)
        if not wants_json and not (ok_a and ok_b):
            continue
        if ok_a != ok_b:
            out.append(Diff("json", f"choice {i}: valid JSON {ok_a} vs {ok_b}"))
            continue
        if not ok_a:
            continue
        if schema is not None:
            valid = [_schema_ok(v, schema) for v in (va, vb)]
            if valid[0] != valid[1]:
                out.append(Diff("json", f"choice {i}: matches the schema {valid[0]} vs {valid[1]}"))
        if json_shape(va) != json_shape(vb):
            out.append(Diff("json", f"choice {i}: JSON shapes differ"))


def _schema_ok(value: Any, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    except jsonschema.SchemaError:
        return False
    return True


def _tool_signature(call: dict[str, Any]) -> tuple[str, bool, tuple[str, ...]]:
    ok, args = _parse_json(call.get("arguments") or "")
    keys = tuple(sorted(args)) if ok and isinstance(args, dict) else ()
    return call.get("name") or "", ok, keys


def _compare_tools(a: Answer, b: Answer, out: list[Diff]) -> None:
    for i, (x, y) in enumerate(zip(a.tool_calls, b.tool_calls, strict=False)):
        if len(x) != len(y):
            out.append(Diff("tool_calls", f"choice {i}: {len(x)} vs {len(y)} tool calls"))
            continue
        for k, (cx, cy) in enumerate(zip(x, y, strict=True)):
            sx, sy = _tool_signature(cx), _tool_signature(cy)
            if sx != sy:
                out.append(Diff("tool_calls", f"choice {i} call {k}: (name, valid args, keys) {sx} vs {sy}"))


def compare_answers(request: dict[str, Any], a: Capture | Answer, b: Capture | Answer) -> Comparison:
    """Every tier's differences between answers `a` and `b` to `request` (the JSON body sent)."""
    a = a if isinstance(a, Answer) else answer_of(a)
    b = b if isinstance(b, Answer) else answer_of(b)
    out: list[Diff] = []
    if a.status != b.status:
        out.append(Diff("status", f"HTTP {a.status} vs {b.status}"))
        return Comparison(out)
    if a.status != 200:
        if (a.error_type, a.error_code) != (b.error_type, b.error_code):
            out.append(Diff("error_body", f"error (type, code) {(a.error_type, a.error_code)} vs "
                                          f"{(b.error_type, b.error_code)}"))
        return Comparison(out)
    _compare_text(request, a, b, out)
    if a.finish != b.finish:
        out.append(Diff("finish_reason", f"{a.finish} vs {b.finish}"))
    _compare_usage(request, a, b, out)
    _compare_stream(a, b, out)
    _compare_json(request, a, b, out)
    _compare_tools(a, b, out)
    return Comparison(out)


def subtract_noise(signal: Comparison, noise: Comparison) -> Comparison:
    """Diffy's rule for one request: tiers in which the primary also differed from itself are noise."""
    return signal.without(noise.tiers)


def tier_rates(comparisons: list[Comparison]) -> dict[str, float]:
    """Share of comparisons with a difference in each tier (every tier listed, 0.0 when none)."""
    n = len(comparisons)
    return {tier: (sum(tier in c.tiers for c in comparisons) / n if n else 0.0)
            for tier in HARD_TIERS + SOFT_TIERS}


def divergence_report(signal: list[Comparison], noise: list[Comparison]) -> dict[str, Any]:
    """Per tier: the candidate's divergence rate, the primary-vs-itself noise rate, and the rate
    left after subtracting noise request by request (`signal[i]` and `noise[i]` are the same
    request). Plus the overall diverged shares. Raises ValueError when the lists differ in length."""
    if len(signal) != len(noise):
        raise ValueError(f"{len(signal)} candidate comparisons but {len(noise)} noise comparisons")
    clean = [subtract_noise(s, z) for s, z in zip(signal, noise, strict=True)]
    n = len(signal)
    raw, noisy, net = tier_rates(signal), tier_rates(noise), tier_rates(clean)
    return {
        "requests": n,
        "diverged_rate": sum(c.diverged for c in signal) / n if n else 0.0,
        "noise_rate": sum(c.diverged for c in noise) / n if n else 0.0,
        "diverged_beyond_noise_rate": sum(c.diverged for c in clean) / n if n else 0.0,
        "tiers": {t: {"divergence_rate": raw[t], "noise_rate": noisy[t], "beyond_noise_rate": net[t]} for t in raw},
    }
