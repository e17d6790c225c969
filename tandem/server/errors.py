"""OpenAI error JSON (``{"error": {"message", "type", "param", "code"}}``) and the exceptions behind it.

Every failure the server reports goes through ``APIError`` so that status, type and code stay
consistent; FastAPI exception handlers turn validation errors, ``ValueError`` subclasses with a
``param`` (``SamplingParamsError``, ``PromptError``) and engine errors into these bodies.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.engine.processor import PromptError
from tandem.errors import ContextLengthExceededError, DuplicateRequestError, EngineDeadError, EngineRequestError
from tandem.sampling_params import SamplingParamsError

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered with an HTTP status and an OpenAI error body."""

    def __init__(
        self, status: int, message: str, type: str, param: str | None = None, code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after  # seconds, sent as the Retry-After header (429, 503)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))  # NOTE: whole seconds (RFC 9110)
        return headers

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400: an invalid parameter or prompt."""
    return APIError(400, message, "invalid_request_error", param, code)


def invalid_api_key() -> APIError:
    """401: a missing or wrong API key (OpenAI's body for the same case)."""
    return APIError(401, "Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key")


def model_not_found(model: str) -> APIError:
    """404: the request names a model this server does not serve."""
    return APIError(
        404, f"The model `{model}` does not exist or you do not have access to it.",
        "invalid_request_error", "model", "model_not_found",
    )


def queue_full(message: str, retry_after: float | None = 1.0) -> APIError:
    """429 with ``Retry-After``: a waiting queue is full (``--max-queue-len``, the tokenizer's, the core's)."""
    return APIError(429, message, "rate_limit_error", None, "queue_full", retry_after)


def engine_unavailable(message: str = "the engine core is not running", retry_after: float | None = None,
                       code: str = "engine_unavailable") -> APIError:
    """503: the engine core is dead, restarting (with ``Retry-After``) or the server is shutting down;
    or (``code`` "kv_transfer_failed") a request's KV could not come from its prefill engine."""
    return APIError(503, message, "service_unavailable", None, code, retry_after)


def from_value_error(e: ValueError) -> APIError:
    """400 from a ``SamplingParamsError`` / ``PromptError`` / typed request error (``param`` names the
    field; ``ContextLengthExceededError`` carries the code ``context_length_exceeded``)."""
    code = "duplicate_request_id" if isinstance(e, DuplicateRequestError) else getattr(e, "code", None)
    return bad_request(str(e), getattr(e, "param", None), code)


def from_engine_error(e: EngineRequestError | EngineDeadError) -> APIError:
    """Maps an engine rejection (400 / 429) or the engine's absence (503) to an ``APIError``."""
    if isinstance(e, EngineDeadError):
        return engine_unavailable(str(e), e.retry_after)
    if e.status == 429:
        return queue_full(e.message, e.retry_after)
    if e.status == 503:  # NOTE: a failed KV transfer (the prefill engine is gone): retry elsewhere
        return engine_unavailable(e.message, e.retry_after, "kv_transfer_failed")
    if e.status >= 500:
        return APIError(e.status, e.message, "internal_error", None, "engine_step_failed")
    return bad_request(e.message, None, e.code)


_SCALAR_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


def _is_union_tag(part: str | int) -> bool:
    """True for the member names pydantic puts in the location of a union error (``str``,
    ``list[int]``, ``list[dict[str,any]]``; not ``[key]``); protocol field names never look like that."""
    return isinstance(part, str) and not part.startswith("[") and ("[" in part or part in _SCALAR_TAGS)


# The field a body must have, per route: named in the 400 for a missing or empty body.
REQUIRED_FIELD = {"/v1/completions": "prompt", "/v1/chat/completions": "messages", "/detokenize": "tokens"}


def _validation_error(exc: RequestValidationError, path: str = "") -> APIError:
    """400 for the first failing field. ``param`` is the top-level field (``prompt``, ``messages``);
    the message gives the full path. A union that matched no member lists the members it expects.
    A missing body names the route's required field."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") in ("missing", "model_attributes_type"):
        required = REQUIRED_FIELD.get(path)
        needs = f" with the field {required!r}" if required else ""
        return bad_request(f"the request body must be a JSON object{needs}", required)
    if first.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip())
    loc = [p for p in first.get("loc", ()) if p != "body"]
    tag_at = next((i for i, p in enumerate(loc) if _is_union_tag(p)), None)
    path = loc if tag_at is None else loc[:tag_at]
    param = str(path[0]) if path else None
    message = first.get("msg", "invalid value")
    if tag_at is not None:
        members = []
        for e in errors:
            e_loc = [p for p in e.get("loc", ()) if p != "body"]
            if e_loc[:tag_at] == path and len(e_loc) > tag_at and e_loc[tag_at] not in members:
                members.append(e_loc[tag_at])
        message = f"Input should be one of: {', '.join(map(str, members))}"
    if path:
        message = f"{'.'.join(map(str, path))}: {message}"
    return bad_request(message, param)


def http_exception_response(exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (unknown path, wrong method) as OpenAI error JSON, headers kept."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    response = APIError(exc.status_code, str(exc.detail), kind).response()
    response.headers.update(exc.headers or {})  # NOTE: a 405 lists the allowed methods (Allow, RFC 9110)
    return response


def install_error_handlers(app: FastAPI) -> None:
    """Registers handlers so that every error leaves as OpenAI error JSON (user mistakes as 4xx)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc, request.url.path).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return http_exception_response(exc)

    @app.exception_handler(SamplingParamsError)
    @app.exception_handler(PromptError)
    @app.exception_handler(ContextLengthExceededError)
    @app.exception_handler(DuplicateRequestError)
    async def _value(_: Request, exc: ValueError) -> JSONResponse:
        return from_value_error(exc).response()

    @app.exception_handler(EngineRequestError)
    @app.exception_handler(EngineDeadError)
    async def _engine(_: Request, exc: EngineRequestError | EngineDeadError) -> JSONResponse:
        return from_engine_error(exc).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error", exc_info=exc)
        return APIError(500, f"internal server error: {type(exc).__name__}", "internal_error").response()
