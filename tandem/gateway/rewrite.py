"""What the gateway changes in a request for one backend, and undoes in the answer.

Two changes, both invisible to the client:
- model-name mapping: a backend whose `model_map` renames the client's `model` gets its own name,
  and every `"model": "<backend name>"` in its answer (the JSON body, each SSE chunk) is given back
  as the client's name, as LiteLLM answers with the model name the client asked for; in a model
  list (`GET /v1/models`) each mapped `"id"` is given back the same way;
- stream usage: a streamed request that did not ask for `stream_options.include_usage` is sent with
  it, so that the gateway can count the request's tokens; the answer's final usage chunk
  (`choices: []`) and the `"usage": null` that OpenAI-style servers then add to every other chunk
  are removed, so the client sees the stream it asked for.

Anything else is forwarded byte for byte: the body unchanged when neither applies, and in an answer
only those key/value pairs are touched (the rest of each line keeps its bytes). The edits are made
on the JSON text, never inside a string: in valid JSON a `"` that follows `{` or `,` (blanks aside)
opens a key, since inside a string it would be escaped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tandem.gateway.config import BackendConfig

_USAGE_NULL_AFTER = re.compile(rb'\s*,\s*"usage"\s*:\s*null(?=\s*[,}])')
_USAGE_NULL_FIRST = re.compile(rb'(?<=\{)\s*"usage"\s*:\s*null\s*(,\s*)?')


@dataclass(frozen=True)
class Rewrite:
    """One request as sent to one backend. body: the bytes to send; renames: (JSON key, the
    backend's model name, the client's) to give back in the answer; usage_added: the gateway asked
    for stream usage that the client did not."""

    body: bytes
    renames: tuple[tuple[str, str, str], ...] = ()
    usage_added: bool = False

    @property
    def changes_answer(self) -> bool:
        return bool(self.renames) or self.usage_added


def _wants_usage(parsed: dict[str, Any]) -> bool:
    options = parsed.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def listing_rewrite(backend: BackendConfig, raw: bytes, path: str = "models") -> tuple[str, Rewrite]:
    """A `GET /v1/models` or `/v1/models/{id}` (`path` under /v1) for `backend`: the path with a
    mapped id renamed, and the Rewrite that gives each mapped model id back in the answer (when two
    client names map to one backend name, the first one)."""
    asked = path.removeprefix("models/") if path.startswith("models/") else None
    if asked in backend.model_map:
        own = backend.model_map[asked]
        return f"models/{own}", Rewrite(raw, (("id", own, asked),))
    back: dict[str, str] = {}
    for client, own in backend.model_map.items():
        back.setdefault(own, client)
    return path, Rewrite(raw, tuple(("id", own, client) for own, client in back.items()))


def rewrite_request(backend: BackendConfig, raw: bytes, parsed: Any, generation: bool) -> Rewrite:
    """The body for `backend`: `raw` unchanged, or with `model` renamed by the backend's map and/or
    `stream_options.include_usage` set on a streamed generation request (`generation`: a POST to
    /v1/completions or /v1/chat/completions with a JSON object body)."""
    if not isinstance(parsed, dict):
        return Rewrite(raw)
    changed: dict[str, Any] = {}
    renames: tuple[tuple[str, str, str], ...] = ()
    model = parsed.get("model")
    if isinstance(model, str) and model in backend.model_map:
        renames = (("model", backend.model_map[model], model),)
        changed["model"] = backend.model_map[model]
    usage_added = generation and parsed.get("stream") is True and not _wants_usage(parsed)
    if usage_added:
        options = parsed.get("stream_options")
        options = dict(options) if isinstance(options, dict) else {}
        if "continuous_usage_stats" in options:  # NOTE: vLLM's per-chunk usage; only the final chunk is wanted
            options["continuous_usage_stats"] = False
        changed["stream_options"] = {**options, "include_usage": True}
    if not changed:
        return Rewrite(raw)
    return Rewrite(json.dumps({**parsed, **changed}).encode(), renames, usage_added)


def _either_escaping(name: str) -> bytes:
    """A pattern for `name` as a JSON string, non-ASCII characters escaped or not."""
    forms = {json.dumps(name).encode(), json.dumps(name, ensure_ascii=False).encode()}
    return b"(?:" + b"|".join(re.escape(f) for f in sorted(forms)) + b")"


class AnswerFilter:
    """Undoes a Rewrite in one backend answer: `json_body` for a whole answer, `feed` / `finish` for
    an SSE stream (its bytes in order; complete lines are edited and returned, a partial line waits
    for the rest). State: the partial line, and whether the blank line ending a dropped event is due."""

    def __init__(self, rewrite: Rewrite) -> None:
        self.rewrite = rewrite
        self._renames = [(re.compile(rb'([{,]\s*' + re.escape(json.dumps(key).encode()) + rb'\s*:\s*)'
                                     + _either_escaping(own) + rb'(?=\s*[,}])'),
                          json.dumps(client, ensure_ascii=False).encode()) for key, own, client in rewrite.renames]
        self._pending = b""
        self._drop_blank = False

    def _rename(self, text: bytes) -> bytes:
        for pattern, client in self._renames:
            text = pattern.sub(lambda m, c=client: m.group(1) + c, text)
        return text

    def json_body(self, raw: bytes) -> bytes:
        """A whole JSON answer with the backend's model names given back as the client's."""
        return self._rename(raw)

    def feed(self, chunk: bytes) -> bytes:
        """The complete lines of `pending + chunk`, edited; the trailing partial line is kept."""
        if not self.rewrite.changes_answer:
            return chunk
        *lines, self._pending = (self._pending + chunk).split(b"\n")
        return b"".join(self._line(line + b"\n") for line in lines)

    def finish(self) -> bytes:
        """What was left after the last newline, edited (the stream ended without one)."""
        rest, self._pending = self._pending, b""
        return self._line(rest) if rest else b""

    def _line(self, line: bytes) -> bytes:
        if self._drop_blank:
            self._drop_blank = False
            if not line.strip():
                return b""
        if not line.startswith(b"data:"):
            return line
        if self.rewrite.usage_added:
            if self._is_usage_chunk(line[5:]):
                self._drop_blank = True
                return b""
            line = _USAGE_NULL_FIRST.sub(b"", _USAGE_NULL_AFTER.sub(b"", line))
        return self._rename(line)

    @staticmethod
    def _is_usage_chunk(data: bytes) -> bool:
        try:
            event = json.loads(data)
        except ValueError:
            return False
        return isinstance(event, dict) and event.get("choices") == [] and isinstance(event.get("usage"), dict)
