"""``tandem router --prefill URL ... --decode URL ...``: an OpenAI-compatible proxy for P/D disaggregation.

One request, as vLLM's disaggregation proxy and vllm-router's PD mode send it:
1. Choose a decode server and a prefill server, each the one with the fewest requests in flight
   through this proxy (least-load; ties go to the first listed).
2. With ``--disagg-min-prompt-tokens N`` the prompt is counted with the decode server's ``/tokenize``;
   fewer than N tokens go straight to the decode server (a prefill leg would cost more than it
   saves). NOTE: the count is of all prompt tokens, not of those missing from the decode server's
   prefix cache (this proxy does not follow its cache).
3. Prefill leg: the client's body with ``"kv_transfer_params": {"do_remote_decode": true, ...}``,
   ``max_tokens`` (and ``max_completion_tokens``) 1, ``n`` 1, ``stream`` false, no ``stream_options``,
   ``min_tokens`` or ``best_of``. A refusal (4xx) is the client's answer; an unreachable prefill server,
   or one answering 5xx (its engine died or restarts), sends the request to the decode server alone (it
   prefills itself), as do several prompts in one body and prompt logprobs (``decode_only``).
4. Decode leg: the client's body plus the ``kv_transfer_params`` of the prefill leg's response; its
   answer (an SSE stream or JSON) is relayed to the client as it comes. A client that leaves closes
   the decode leg, so the decode server aborts and frees both sides' blocks.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tandem.config import ConfigError
from tandem.server.errors import APIError

logger = logging.getLogger(__name__)

PREFILL_LEG_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                      "remote_block_ids": None, "remote_host": None, "remote_port": None}
_FORWARD_HEADERS = ("authorization", "x-request-id")
CONNECT_ATTEMPTS = 2  # per leg: a connect timeout is tried once more (a refused connection is not)


@dataclass(frozen=True)
class PDConfig:
    """Settings of the P/D proxy: server base URLs (without ``/v1``), the short-prompt threshold
    (tokens; 0 = every request takes both legs), the listen address and timeouts (seconds).

    Raises (on creation): ConfigError: no prefill or no decode server, a malformed URL, a bad bound.
    """

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    min_prompt_tokens: int = 0
    host: str = "127.0.0.1"
    port: int = 8080
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ConfigError("P/D routing needs at least one --prefill and one --decode server")
        for url in self.prefill + self.decode:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ConfigError(f"a server must be an http(s) URL like http://127.0.0.1:8000, got {url!r}")
        if self.min_prompt_tokens < 0:
            raise ConfigError(f"--disagg-min-prompt-tokens must be >= 0, got {self.min_prompt_tokens}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be 0-65535, got {self.port}")


class PDProxy:
    """Pairs prefill and decode servers per request (see the module docstring).

    ``outstanding``: requests in flight per server URL through this proxy (the least-load signal).
    ``num_direct`` / ``num_disaggregated`` / ``num_prefill_unreachable``: cumulative request counts.
    """

    def __init__(self, config: PDConfig, client: httpx.AsyncClient | None = None) -> None:
        self.config = config
        self.prefill = [u.rstrip("/") for u in config.prefill]
        self.decode = [u.rstrip("/") for u in config.decode]
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout_s,
                                                                        connect=config.connect_timeout_s))
        self.outstanding = dict.fromkeys(self.prefill + self.decode, 0)
        self.num_direct = self.num_disaggregated = self.num_prefill_unreachable = 0

    def choose(self, urls: list[str]) -> str:
        """The server with the fewest requests in flight (the first listed on a tie). Changes nothing."""
        return min(urls, key=lambda u: self.outstanding[u])

    async def handle(self, request: Request, path: str) -> Response:
        """Answers one ``POST path`` (``/v1/completions`` or ``/v1/chat/completions``)."""
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return APIError(400, "the body is not valid JSON", "invalid_request_error", None, None).response()
        if not isinstance(body, dict):
            return APIError(400, "the body must be a JSON object", "invalid_request_error", None, None).response()
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS}
        decode = self.choose(self.decode)
        if decode_only(body) or self.config.min_prompt_tokens and await self._is_short(decode, body, headers):
            self.num_direct += 1
            return await self._relay(decode, path, body, headers)
        prefill = self.choose(self.prefill)
        self.outstanding[prefill] += 1
        try:
            answer = await self._send(self.client.build_request("POST", prefill + path, json=prefill_leg(body),
                                                                headers=headers), stream=False)
        except httpx.HTTPError as e:
            logger.warning("prefill server %s unreachable (%s): the decode server prefills itself", prefill, _why(e))
            self.num_prefill_unreachable += 1
            return await self._relay(decode, path, body, headers)
        finally:
            self.outstanding[prefill] -= 1
        if answer.status_code >= 500:  # NOTE: its engine died or is restarting: the decode engine can prefill
            logger.warning("prefill server %s answered %d: the decode server prefills itself", prefill,
                           answer.status_code)
            self.num_prefill_unreachable += 1
            return await self._relay(decode, path, body, headers)
        if answer.status_code != 200:
            return Response(answer.content, answer.status_code, media_type="application/json",
                            headers=_retry_after(answer))
        params = answer.json().get("kv_transfer_params")
        self.num_disaggregated += 1
        return await self._relay(decode, path, {**body, "kv_transfer_params": params} if params else body, headers)

    async def _send(self, request: httpx.Request, stream: bool) -> httpx.Response:
        """Sends ``request``, once more after a connect timeout (nothing was sent: a loop busy with many
        streams can miss ``connect_timeout_s`` on loopback). Raises: httpx.HTTPError: the last failure."""
        for _ in range(CONNECT_ATTEMPTS - 1):
            try:
                return await self.client.send(request, stream=stream)
            except httpx.ConnectTimeout:
                logger.warning("connect timeout to %s: trying again", request.url)
        return await self.client.send(request, stream=stream)

    async def _is_short(self, decode: str, body: dict[str, Any], headers: dict[str, str]) -> bool:
        query = {"messages": body["messages"]} if "messages" in body else {"prompt": body.get("prompt")}
        if not isinstance(query.get("prompt", ""), str) and "prompt" in query:
            return False  # NOTE: token-id or batched prompts: counted as long, they take both legs
        try:
            answer = await self.client.post(decode + "/tokenize", json={"model": body.get("model"), **query},
                                            headers=headers)
            count = answer.json().get("count") if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            count = None
        return isinstance(count, int) and count < self.config.min_prompt_tokens

    async def _relay(self, url: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        """Sends the decode leg and relays its answer (streamed as it comes when ``stream`` is set)."""
        self.outstanding[url] += 1
        try:
            upstream = await self._send(self.client.build_request("POST", url + path, json=body, headers=headers),
                                        stream=True)
        except httpx.HTTPError as e:
            self.outstanding[url] -= 1
            return APIError(502, f"the decode server {url} is unreachable: {_why(e)}", "service_unavailable", None,
                            "decode_unreachable", 1.0).response()
        media = upstream.headers.get("content-type", "application/json")
        if not body.get("stream") or upstream.status_code != 200:
            try:
                content = await upstream.aread()
            finally:
                await upstream.aclose()
                self.outstanding[url] -= 1
            return Response(content, upstream.status_code, media_type=media, headers=_retry_after(upstream))
        return StreamingResponse(self._chunks(url, upstream), media_type=media)

    async def _chunks(self, url: str, upstream: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()  # NOTE: a client that left closes the decode leg: the server aborts
            self.outstanding[url] -= 1


def decode_only(body: dict[str, Any]) -> bool:
    """True for a body the decode server must prefill itself: several prompts (one prefill leg holds one
    prompt's KV), or prompt logprobs (``prompt_logprobs``, ``echo`` with ``logprobs`` or ``max_tokens`` 0:
    they need every prompt position computed where the answer is made)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and any(isinstance(p, str | list) for p in prompt):
        return True
    return body.get("prompt_logprobs") is not None or bool(body.get("echo")) and (
        body.get("logprobs") is not None or body.get("max_tokens") == 0)


def prefill_leg(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body for a client body (vLLM's proxy protocol; see the module docstring): one
    completion of one token (``n`` / ``best_of`` 1, no ``min_tokens``: the decode leg samples them all)."""
    leg = {**body, "kv_transfer_params": dict(PREFILL_LEG_PARAMS), "stream": False, "max_tokens": 1}
    for key in ("stream_options", "min_tokens", "best_of"):
        leg.pop(key, None)
    if "n" in leg:
        leg["n"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    return leg


def _why(e: httpx.HTTPError) -> str:
    """An httpx error for a message: its type, and its text when it has one (a timeout's is empty)."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _retry_after(answer: httpx.Response) -> dict[str, str]:
    value = answer.headers.get("retry-after")
    return {"Retry-After": value} if value else {}


def build_pd_app(proxy: PDProxy) -> FastAPI:
    app = FastAPI(title="tandem P/D router")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.handle(request, "/v1/chat/completions")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> Response:
        answer = await proxy.client.get(proxy.decode[0] + "/v1/models")
        return Response(answer.content, answer.status_code, media_type="application/json")

    @app.get("/backends")
    async def backends() -> JSONResponse:
        return JSONResponse({"prefill": proxy.prefill, "decode": proxy.decode, "outstanding": proxy.outstanding,
                             "num_direct": proxy.num_direct, "num_disaggregated": proxy.num_disaggregated,
                             "num_prefill_unreachable": proxy.num_prefill_unreachable})

    return app


def add_pd_args(parser: argparse.ArgumentParser) -> None:
    """Adds ``--prefill``, ``--decode`` and ``--disagg-min-prompt-tokens`` to ``tandem router``."""
    g = parser.add_argument_group("prefill/decode disaggregation (instead of --backend)")
    g.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="a prefill server (kv_role kv_producer), e.g. http://127.0.0.1:8100; repeat")
    g.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a decode server (kv_role kv_consumer); repeat")
    g.add_argument("--disagg-min-prompt-tokens", type=int, default=0,
                   help="prompts with fewer tokens go straight to a decode server (default 0: none)")


def pd_config_from_args(args: argparse.Namespace) -> PDConfig:
    return PDConfig(prefill=tuple(args.prefill), decode=tuple(args.decode),
                    min_prompt_tokens=args.disagg_min_prompt_tokens, host=args.host, port=args.port,
                    connect_timeout_s=args.connect_timeout, request_timeout_s=args.request_timeout)


def cmd_pd_router(args: argparse.Namespace) -> int:
    """``tandem router --prefill ... --decode ...``: serves the P/D proxy until interrupted."""
    import uvicorn

    if args.backend:
        raise ValueError("--backend cannot be combined with --prefill/--decode (P/D routing)")
    proxy = PDProxy(pd_config_from_args(args))
    uvicorn.run(build_pd_app(proxy), host=args.host, port=args.port, log_level="warning")
    return 0
