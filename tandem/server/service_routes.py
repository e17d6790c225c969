"""The open service routes (no API key, as in vLLM): ``/health``, ``/load``, ``/version``, ``/metrics``,
``/tokenize``, ``/detokenize`` and vLLM's ``/tokenizer_info``, with their documented response shapes."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

import tandem
from tandem.engine.async_llm import AsyncLLM
from tandem.engine.processor import PromptError
from tandem.server import errors
from tandem.server.metrics import CONTENT_TYPE, ServerMetrics
from tandem.server.openapi import error_responses
from tandem.server.protocol import DetokenizeRequest, TokenizeRequest
from tandem.server.serving_common import ModelNames


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
    kernel_backend: str


class TokenizerInfoResponse(BaseModel):
    """vLLM's ``/tokenizer_info``: the tokenizer's ``tokenizer_config.json`` fields as loaded (file paths
    left out), its class and the chat template in use."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str


def tokenizer_info(tokenizer: Any, chat_template: str | None) -> dict[str, Any]:
    """The ``/tokenizer_info`` body (vLLM's shape): ``init_kwargs`` made JSON-safe (``AddedToken`` ->
    its text, other objects -> ``str``), without ``vocab_file`` / ``merges_file`` / ``tokenizer_file``."""

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [plain(v) for v in value]
        if value is None or isinstance(value, str | int | float | bool):
            return value
        return getattr(value, "content", None) if hasattr(value, "content") else str(value)

    config = {k: v for k, v in dict(getattr(tokenizer, "init_kwargs", None) or {}).items()
              if k not in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")}
    info = plain(config)
    info["tokenizer_class"] = type(tokenizer).__name__
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        info["chat_template"] = template
    return info


def add_service_routes(app: FastAPI, engine: AsyncLLM, names: ModelNames, metrics: ServerMetrics) -> None:
    """Health, load, version, metrics, tokenize, detokenize and tokenizer info."""

    health_responses = {200: {"description": "The engine serves (empty body)", "content": {}},
                        **error_responses(503)}

    @app.get("/health", responses=health_responses, response_class=Response)
    async def health() -> Response:
        engine.check_available()
        return Response(status_code=200)

    @app.head("/health", responses=health_responses, response_class=Response, operation_id="health_head")
    async def health_head() -> Response:
        return await health()

    @app.get("/load")
    async def load() -> JSONResponse:
        """Running / waiting engine requests, KV usage (0..1), block size (tokens), instance id."""
        return JSONResponse(engine.load())

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=tandem.__version__, kernel_backend=engine.client.kernel_backend)

    @app.get("/metrics", response_class=Response, responses={
        200: {"description": "Prometheus text exposition format 0.0.4",
              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=error_responses(400, 404))
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        names.resolve(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise errors.bad_request("give exactly one of prompt or messages", "prompt")
        source = body.prompt if body.messages is None else [m.to_template_message(i) for i, m in
                                                            enumerate(body.messages)]
        ids = await engine.run_in_tokenizer(engine.count_tokens, source, body.add_special_tokens,
                                            body.add_generation_prompt, body.chat_template_kwargs)
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=error_responses(400, 404))
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        names.resolve(body.model)
        vocab = engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise PromptError(f"token id {bad[0]} is out of the vocabulary [0, {vocab})", "tokens")
        return DetokenizeResponse(prompt=await engine.run_in_tokenizer(engine.decode, body.tokens))

    info = tokenizer_info(engine.tokenizer, engine.frontend.chat_template)

    @app.get("/tokenizer_info", response_model=TokenizerInfoResponse)
    async def get_tokenizer_info() -> JSONResponse:
        return JSONResponse(info)
