"""Typed errors shared by the engine and the server; the server maps each to one HTTP status.

``EngineDeadError`` -> 503, ``EngineRequestError`` -> its ``status`` (400 / 429),
``DuplicateRequestError`` and ``ContextLengthExceededError`` -> 400 (the latter with code
``context_length_exceeded``). They live here, not in the server, so the engine core and the front
end raise them without importing FastAPI.
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core is not serving (killed, crashed, restarting, or shut down): HTTP 503.

    ``retry_after``: seconds a client should wait before retrying (None: the core will not come back).
    """

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineRequestError(Exception):
    """The engine refused a request: ``status`` 400 (it can never run) or 429 (a queue is full).

    ``retry_after``: seconds before a retry may succeed (sent as ``Retry-After`` with 429).
    """

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


class DuplicateRequestError(ValueError):
    """A request id that is already in use (the engine or the front end holds a live request with it)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request id {request_id!r} is already in use")
        self.request_id = request_id
        self.param = "request_id"


class ContextLengthExceededError(ValueError):
    """A prompt (plus the completion asked for) longer than the model's context (OpenAI code
    ``context_length_exceeded``). ``param`` names the request field: "prompt" or "messages"."""

    code = "context_length_exceeded"

    def __init__(self, message: str, param: str | None = "prompt") -> None:
        super().__init__(message)
        self.param = param


def context_length_message(max_model_len: int, detail: str) -> str:
    """The one wording of a too-long request: "This model's maximum context length is N tokens. However, ..."."""
    return f"This model's maximum context length is {max_model_len} tokens. However, {detail}"
