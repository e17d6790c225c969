"""The OpenAPI document (``/openapi.json``) as the server behaves: error statuses with OpenAI's error
body (400 for every validation error, never FastAPI's default 422), SSE streams, plain-text metrics, the
bearer key on ``/v1`` when one is set.

Routes declare their own statuses with ``error_responses``; ``install_openapi`` then replaces FastAPI's
generated 422 entries and its validation-error schemas.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from tandem.server.protocol import VOCAB_ID


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body, for every 4xx and 5xx the server answers."""

    error: ErrorBody


_MEANINGS = {
    400: "Invalid request: a field out of range or unsupported, a bad prompt, a duplicate request id",
    401: "Missing or wrong API key",
    404: "The model is not served here",
    429: "A waiting queue is full; retry after the Retry-After header's seconds",
    500: "The engine step that ran this request failed (the server serves on)",
    503: "The engine core is down or restarting (Retry-After when it comes back) or the server is stopping",
}
SSE = {"text/event-stream": {"schema": {"type": "string", "description": "Server-Sent Events, then data: [DONE]"}}}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for a route: each status with ``ErrorResponse`` and what it means."""
    return {status: {"model": ErrorResponse, "description": _MEANINGS[status]} for status in statuses}


def generation_responses(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The statuses of ``/v1/completions`` and ``/v1/chat/completions``: JSON or an SSE stream."""
    return {200: {"model": model, "description": "The completion, or its stream when `stream` is true",
                  "content": SSE}, **error_responses(400, 404, 429, 500, 503)}


def install_openapi(app: FastAPI, api_key: bool, vocab_size: int) -> None:
    """Makes ``app.openapi()`` document 400 instead of 422, token ids below ``vocab_size``, and the
    bearer key on ``/v1`` routes when ``api_key`` (each then also answers 401). Changes: ``app.openapi``."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _bound_token_ids(schema, vocab_size - 1)
            _exact_bounds(schema)
            for path, item in schema["paths"].items():
                for operation in item.values():
                    operation["responses"].pop("422", None)
                    if api_key and path.startswith("/v1/"):
                        operation["security"] = [{"bearer": []}]
                        operation["responses"]["401"] = _error_ref(_MEANINGS[401])
            components = schema.setdefault("components", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.get("schemas", {}).pop(name, None)
            if api_key:
                components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _error_ref(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def _bound_token_ids(node: Any, max_id: int) -> None:
    """Replaces each token-id marker (``protocol.VOCAB_ID``) with ``maximum: max_id``, in place."""
    if isinstance(node, dict):
        if node.pop(VOCAB_ID, False):
            node["maximum"] = max_id
        for value in node.values():
            _bound_token_ids(value, max_id)
    elif isinstance(node, list):
        for value in node:
            _bound_token_ids(value, max_id)


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _exact_bounds(node: Any) -> None:
    """Integer bounds as integers, in place. FastAPI's OpenAPI model holds bounds as floats, which turns
    0 into 0.0 and rounds the int64 maximum 2**63 - 1 up to 2**63 (``seed`` read 9223372036854775808)."""
    if isinstance(node, dict):
        for key in _BOUNDS:
            value = node.get(key)
            if isinstance(value, float) and value.is_integer():
                node[key] = 2**63 - 1 if value == 2.0**63 and key == "maximum" else int(value)
        for value in node.values():
            _exact_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _exact_bounds(value)
