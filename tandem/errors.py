"""Typed errors shared by the engine and the server; the server maps each to one HTTP status
(no message matching needed), and they live here so the engine core raises them without FastAPI.

``DuplicateRequestError`` and ``ContextLengthExceededError`` are user errors (``ValueError``: HTTP
400); ``EngineStepError`` is a failed engine step (a bug or an exhausted resource: HTTP 500 for the
requests it names, the engine itself stays usable); ``EngineDeadError`` is 503 (the core is dead,
restarting or shutting down) and ``EngineRequestError`` carries its own status (400 / 429).
"""

from __future__ import annotations


class DuplicateRequestError(ValueError):
    """A request id that is already queued or running in this engine (HTTP 400).

    ``request_id`` is the offending id; ``param`` the request field naming it (OpenAI error ``param``).
    ``message`` replaces the default text (the server's front end says "already in use").
    """

    param = "request_id"
    code = "duplicate_request_id"

    def __init__(self, request_id: str, message: str | None = None) -> None:
        super().__init__(message or f"request id {request_id!r} is already in the scheduler")
        self.request_id = request_id


class ContextLengthExceededError(ValueError):
    """A prompt (plus the tokens it must leave room for) longer than the context (HTTP 400).

    ``param`` names the request field (OpenAI error ``param``); ``code`` is the OpenAI error code
    ``"context_length_exceeded"``. ``num_tokens`` and ``max_model_len`` are in tokens.
    """

    code = "context_length_exceeded"

    def __init__(self, message: str, num_tokens: int, max_model_len: int, param: str | None = "prompt") -> None:
        super().__init__(message)
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len
        self.param = param


class EngineStepError(RuntimeError):
    """An engine step raised between ``schedule()`` and ``update_from_output()``.

    The engine rolled the step back before raising: ``request_ids`` (the requests of that step) were
    aborted and their KV blocks freed without entering the prefix cache, so the engine can keep
    serving. The original exception is ``__cause__``.
    """

    def __init__(self, request_ids: list[str]) -> None:
        super().__init__(f"engine step failed; aborted requests {request_ids}")
        self.request_ids = request_ids


class EngineDeadError(RuntimeError):
    """The engine core is not serving (killed, crashed, restarting, or shut down): HTTP 503.

    ``retry_after``: seconds a client should wait before retrying (None: the core will not come back).
    """

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineRequestError(Exception):
    """The engine refused or failed a request: ``status`` 400 (it can never run), 429 (a queue is
    full) or 500 (its engine step failed). ``retry_after``: seconds before a retry may succeed (sent
    as ``Retry-After`` with 429)."""

    def __init__(self, status: int, message: str, retry_after: float | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after
        self.code = code  # OpenAI error code, e.g. "context_length_exceeded", or None


def context_length_message(max_model_len: int, detail: str) -> str:
    """The one wording of a too-long request: "This model's maximum context length is N tokens. However, ..."."""
    return f"This model's maximum context length is {max_model_len} tokens. However, {detail}"
