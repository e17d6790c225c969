"""OpenAI error JSON (``{"error": {"message", "type", "param", "code"}}``) and the exceptions behind it.

Every failure the server reports goes through ``APIError`` so that status, type and code stay
consistent; FastAPI exception handlers turn validation errors, ``ValueError`` subclasses with a
``param`` (``SamplingParamsError``, ``PromptError``) and engine errors into these bodies.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.engine.async_llm import EngineDeadError, EngineRequestError
from tandem.engine.processor import PromptError
from tandem.sampling_params import SamplingParamsError

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered with an HTTP status and an OpenAI error body."""

    def __init__(
        self, status: int, message: str, type: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


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


def queue_full(message: str) -> APIError:
    """429: the engine's waiting queue is full (``--max-queue-len``)."""
    return APIError(429, message, "rate_limit_error", None, "queue_full")


def engine_unavailable(message: str = "the engine core is not running") -> APIError:
    """503: the engine core process is dead or the server is shutting down."""
    return APIError(503, message, "service_unavailable", None, "engine_unavailable")


def from_value_error(e: ValueError) -> APIError:
    """400 from a ``SamplingParamsError`` / ``PromptError`` (their ``param`` names the field)."""
    message = str(e)
    code = "context_length_exceeded" if "maximum context length" in message else None
    return bad_request(message, getattr(e, "param", None), code)


def from_engine_error(e: EngineRequestError | EngineDeadError) -> APIError:
    """Maps an engine rejection (400 / 429) or the engine's death (503) to an ``APIError``."""
    if isinstance(e, EngineDeadError):
        return engine_unavailable(str(e))
    if e.status == 429:
        return queue_full(e.message)
    return bad_request(e.message)


_SCALAR_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


def _is_union_tag(part: str | int) -> bool:
    """True for the member names pydantic puts in the location of a union error (``str``,
    ``list[int]``, ``list[dict[str,any]]``; not ``[key]``); protocol field names never look like that."""
    return isinstance(part, str) and not part.startswith("[") and ("[" in part or part in _SCALAR_TAGS)


def _validation_error(exc: RequestValidationError) -> APIError:
    """400 for the first failing field. ``param`` is the top-level field (``prompt``, ``messages``);
    the message gives the full path. A union that matched no member lists the members it expects."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
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


def install_error_handlers(app: FastAPI) -> None:
    """Registers handlers so that every error leaves as OpenAI error JSON (user mistakes as 4xx)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), kind).response()

    @app.exception_handler(SamplingParamsError)
    @app.exception_handler(PromptError)
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
