"""Typed engine errors that the server maps to HTTP statuses (no message matching needed).

``DuplicateRequestError`` and ``ContextLengthExceededError`` are user errors (``ValueError``: HTTP
400); ``EngineStepError`` is a failed engine step (a bug or an exhausted resource: HTTP 500 for the
requests it names, the engine itself stays usable).
"""

from __future__ import annotations


class DuplicateRequestError(ValueError):
    """A request id that is already queued or running in this engine (HTTP 400).

    ``request_id`` is the offending id.
    """

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request id {request_id!r} is already in the scheduler")
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
