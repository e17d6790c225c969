"""``tandem router --prefill URL ... --decode URL ...``: an OpenAI-compatible proxy for P/D disaggregation.

One request, as vLLM's disaggregation proxy and vllm-router's PD mode send it:
1. Choose a decode server and a prefill server, each the one with the fewest requests in flight
   through this proxy (least-load; ties go to the first listed) among those not ejected (passive health,
   ``health.BackendHealth``: a connect error ejects a server, ``--failure-threshold`` 5xx answers or
   first-byte timeouts in a row do; once its ejection time is up the next request is its half-open trial).
2. With ``--disagg-min-prompt-tokens N`` the prompt is counted with the decode server's ``/tokenize``;
   fewer than N tokens go straight to the decode server (a prefill leg would cost more than it
   saves). NOTE: the count is of all prompt tokens, not of those missing from the decode server's
   prefix cache (this proxy does not follow its cache).
3. Prefill leg: the client's body with ``"kv_transfer_params": {"do_remote_decode": true, ...}``,
   ``max_tokens`` (and ``max_completion_tokens``) 1, ``n`` 1, ``stream`` false, no ``stream_options``,
   ``min_tokens`` or ``best_of``. A refusal (4xx) is the client's answer; an unreachable prefill server,
   one answering 5xx (its engine died or restarts) or 200 without a JSON object, or one silent for
   ``--first-byte-timeout`` sends the request to the decode server alone (it prefills itself), as do
   several prompts in one body, prompt logprobs (``decode_only``) and every prefill server being ejected
   (until an ejection time is up: that request is the server's half-open trial).
4. Decode leg: the client's body plus the ``kv_transfer_params`` of the prefill leg's response; its
   answer (an SSE stream or JSON) is relayed to the client as it comes. A client that leaves closes
   the decode leg, so the decode server aborts and frees both sides' blocks. A decode server that cannot
   be reached, or sends no byte within ``--first-byte-timeout`` (0: no limit), is left (the connection
   closed) and the request tried once more on another decode server with the client's own body (it
   prefills itself: the first one may hold the transfer's lease); else 502 ``decode_unreachable`` or
   504 ``first_byte_timeout``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tandem.config import ConfigError
from tandem.router.health import BackendHealth, HealthState
from tandem.router.policy import BackendState
from tandem.server.errors import APIError

logger = logging.getLogger(__name__)

PREFILL_LEG_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                      "remote_block_ids": None, "remote_host": None, "remote_port": None}
_FORWARD_HEADERS = ("authorization", "x-request-id")
CONNECT_ATTEMPTS = 2  # per leg: a connect timeout is tried once more (a refused connection is not)
MAX_BODY_DEPTH = 256  # nesting levels of a body's JSON the P/D router takes (OpenAI bodies use about 10)
MODELS_READ_TIMEOUT_S = 5.0  # GET /v1/models of a decode server: a hung one is left for the next


@dataclass(frozen=True)
class PDConfig:
    """Settings of the P/D proxy: server base URLs (without ``/v1``), the short-prompt threshold
    (tokens; 0 = every request takes both legs), the listen address, timeouts (seconds) and passive health
    (``health.BackendHealth``). ``first_byte_timeout_s``: how long a leg may wait for its answer's first
    byte (0, the default: no limit; NOTE: as for ``RouterConfig``, a request without ``stream`` gets its
    first byte only with its whole answer, and a CPU prefill of a long prompt takes seconds to minutes).

    Raises (on creation): ConfigError: no prefill or no decode server, a malformed URL, a bad bound.
    """

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    min_prompt_tokens: int = 0
    host: str = "127.0.0.1"
    port: int = 8080
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 600.0
    first_byte_timeout_s: float = 0.0
    failure_threshold: int = 3
    eject_s: float = 2.0
    max_eject_s: float = 30.0

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
        if not (self.first_byte_timeout_s >= 0 and math.isfinite(self.first_byte_timeout_s)):
            raise ConfigError(f"--first-byte-timeout must be a finite number >= 0, got {self.first_byte_timeout_s}")
        if self.failure_threshold < 1 or not 0 < self.eject_s <= self.max_eject_s:
            raise ConfigError(f"need --failure-threshold >= 1 and 0 < --eject-seconds <= --max-eject-seconds, got "
                              f"{self.failure_threshold}, {self.eject_s}, {self.max_eject_s}")


class PDProxy:
    """Pairs prefill and decode servers per request (see the module docstring).

    ``outstanding``: requests in flight per server URL through this proxy (the least-load signal).
    ``health``: each server's ``BackendHealth`` (passive: connect errors, 5xx, first-byte timeouts).
    ``num_direct`` / ``num_disaggregated`` / ``num_prefill_unreachable`` (timeouts and requests sent to the
    decode server alone because every prefill server was ejected included) /
    ``num_first_byte_timeouts`` (either leg) / ``num_decode_retries``: cumulative request counts.
    """

    def __init__(self, config: PDConfig, client: httpx.AsyncClient | None = None) -> None:
        self.config = config
        self.prefill = [u.rstrip("/") for u in config.prefill]
        self.decode = [u.rstrip("/") for u in config.decode]
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout_s,
                                                                        connect=config.connect_timeout_s))
        self.outstanding = dict.fromkeys(self.prefill + self.decode, 0)
        self.health = {u: BackendHealth(BackendState(u), config.failure_threshold, config.eject_s, config.max_eject_s)
                       for u in self.outstanding}
        self.num_direct = self.num_disaggregated = self.num_prefill_unreachable = 0
        self.num_first_byte_timeouts = self.num_decode_retries = 0

    def choose(self, urls: list[str], exclude: Iterable[str] = (), ejected_too: bool = True) -> str | None:
        """The server with the fewest requests in flight (the first listed on a tie) among ``urls`` minus
        ``exclude`` that are not ejected (or whose ejection time is up: this request is its half-open trial);
        when every one is ejected, all of them (``ejected_too``) or None; None when none is left. Changes: a
        due server's health (half-open)."""
        left = [u for u in urls if u not in exclude]
        routable = [u for u in left if self.health[u].state is not HealthState.EJECTED or self.health[u].due_probe]
        if not left or not (routable or ejected_too):
            return None
        chosen = min(routable or left, key=lambda u: self.outstanding[u])
        if self.health[chosen].due_probe:
            self.health[chosen].on_probe(True)
        return chosen

    async def handle(self, request: Request, path: str) -> Response:
        """Answers one ``POST path`` (``/v1/completions`` or ``/v1/chat/completions``)."""
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return APIError(400, "the body is not valid JSON", "invalid_request_error", None, None).response()
        except RecursionError:
            return APIError(400, "the body is not valid JSON: nested too deeply", "invalid_request_error", None,
                            None).response()
        if not isinstance(body, dict):
            return APIError(400, "the body must be a JSON object", "invalid_request_error", None, None).response()
        refused = check_body(body)
        if refused is not None:
            return refused.response()
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS}
        decode = self.choose(self.decode)
        if decode_only(body) or self.config.min_prompt_tokens and await self._is_short(decode, body, headers):
            self.num_direct += 1
            return await self._relay(decode, path, body, headers, body)
        prefill = self.choose(self.prefill, ejected_too=False)
        if prefill is None:  # NOTE: each would cost a connect error or a first-byte timeout before the fallback
            self.num_prefill_unreachable += 1
            return await self._relay(decode, path, body, headers, body)
        self.outstanding[prefill] += 1
        try:
            answer = await self._post(prefill, path, prefill_leg(body), headers)
        except (httpx.HTTPError, TimeoutError) as e:
            logger.warning("prefill server %s %s: the decode server prefills itself", prefill, self._failed(prefill, e))
            self.num_prefill_unreachable += 1
            return await self._relay(decode, path, body, headers, body)
        finally:
            self.outstanding[prefill] -= 1
        self.health[prefill].on_response(answer.status_code)
        if answer.status_code >= 500:  # NOTE: its engine died or is restarting: the decode engine can prefill
            logger.warning("prefill server %s answered %d: the decode server prefills itself", prefill,
                           answer.status_code)
            self.num_prefill_unreachable += 1
            return await self._relay(decode, path, body, headers, body)
        if answer.status_code != 200:
            return Response(answer.content, answer.status_code, media_type="application/json",
                            headers=_retry_after(answer))
        try:
            params = answer.json().get("kv_transfer_params")
        except (ValueError, AttributeError):  # NOTE: not a JSON object: the decode server can still prefill
            self.health[prefill].on_failure("answered 200 without a JSON object")
            logger.warning("prefill server %s answered 200 without a JSON object: the decode server prefills itself",
                           prefill)
            self.num_prefill_unreachable += 1
            return await self._relay(decode, path, body, headers, body)
        self.num_disaggregated += 1
        return await self._relay(decode, path, {**body, "kv_transfer_params": params} if params else body, headers,
                                 body)

    async def models(self, headers: dict[str, str]) -> Response:
        """The first decode server's ``GET /v1/models`` answer that is not a 5xx (those not ejected asked
        first); 502 ``decode_unreachable`` as OpenAI error JSON when none answers. No state changes."""
        order = sorted(self.decode, key=lambda u: self.health[u].state is HealthState.EJECTED)
        failures = []
        timeout = httpx.Timeout(MODELS_READ_TIMEOUT_S, connect=self.config.connect_timeout_s)
        for url in order:
            try:
                answer = await self.client.get(url + "/v1/models", headers=headers, timeout=timeout)
            except httpx.HTTPError as e:
                failures.append(f"{url}: {_why(e)}")
                continue
            if answer.status_code < 500:
                return Response(answer.content, answer.status_code, media_type="application/json")
            failures.append(f"{url} answered {answer.status_code}")
        return APIError(502, f"no decode server answered /v1/models: {'; '.join(failures)}", "bad_gateway", None,
                        "decode_unreachable", 1.0).response()

    async def _send(self, request: httpx.Request, stream: bool) -> httpx.Response:
        """Sends ``request``, once more after a connect timeout (nothing was sent: a loop busy with many
        streams can miss ``connect_timeout_s`` on loopback). Raises: httpx.HTTPError: the last failure."""
        for _ in range(CONNECT_ATTEMPTS - 1):
            try:
                return await self.client.send(request, stream=stream)
            except httpx.ConnectTimeout:
                logger.warning("connect timeout to %s: trying again", request.url)
        return await self.client.send(request, stream=stream)

    async def _open(self, url: str, path: str, body: dict[str, Any],
                    headers: dict[str, str]) -> tuple[httpx.Response, bytes, AsyncIterator[bytes]]:
        """Sends one leg and waits for its answer's first body chunk, at most ``first_byte_timeout_s`` (0: no
        limit); returns the open response, that chunk and the rest (decoded, so Content-Encoding is not
        relayed). Raises: httpx.HTTPError (no connection, a broken answer); TimeoutError (no first byte in
        time; the connection is closed, so the server aborts the request)."""
        upstream = None
        try:
            async with asyncio.timeout(self.config.first_byte_timeout_s or None):
                upstream = await self._send(self.client.build_request("POST", url + path, json=body, headers=headers),
                                            stream=True)
                rest = upstream.aiter_bytes()
                first = await anext(rest, b"")
        except BaseException:
            if upstream is not None:
                await upstream.aclose()
            raise
        return upstream, first, rest

    async def _post(self, url: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
        """One leg's whole answer (see ``_open``). Raises: httpx.HTTPError, TimeoutError."""
        upstream, first, rest = await self._open(url, path, body, headers)
        try:
            content = first + b"".join([chunk async for chunk in rest])
        finally:
            await upstream.aclose()
        kept = {k: v for k, v in upstream.headers.items() if k.lower() in ("content-type", "retry-after")}
        return httpx.Response(upstream.status_code, headers=kept, content=content)

    def _failed(self, url: str, e: Exception) -> str:
        """Counts a leg that failed before its first byte in ``url``'s health; returns why, for a message."""
        if isinstance(e, TimeoutError):
            why = f"sent no response byte within {self.config.first_byte_timeout_s:g} s"
            self.num_first_byte_timeouts += 1
            self.health[url].on_failure(why)
            return why
        self.health[url].on_connect_error(_why(e))
        return f"unreachable ({_why(e)})"

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

    async def _relay(self, url: str, path: str, body: dict[str, Any], headers: dict[str, str],
                     own_body: dict[str, Any]) -> Response:
        """Sends the decode leg and relays its answer (streamed as it comes when ``stream`` is set). A leg that
        fails before its first byte is tried once more on another decode server, with the client's
        ``own_body`` (it prefills itself)."""
        failures: list[tuple[str, Exception]] = []
        while True:
            self.outstanding[url] += 1
            try:
                upstream, first, rest = await self._open(url, path, body, headers)
                break
            except BaseException as e:
                self.outstanding[url] -= 1
                if not isinstance(e, httpx.HTTPError | TimeoutError):
                    raise  # NOTE: cancelled (the client left)
                why = self._failed(url, e)
                failures.append((url, e))
                other = self.choose(self.decode, exclude=[u for u, _ in failures]) if len(failures) < 2 else None
                if other is None:
                    return self._decode_failed(failures)
                logger.warning("decode server %s %s: trying %s", url, why, other)
                self.num_decode_retries += 1
                url, body = other, own_body
        self.health[url].on_response(upstream.status_code)
        media = upstream.headers.get("content-type", "application/json")
        if not body.get("stream") or upstream.status_code != 200:
            try:
                content = first + b"".join([chunk async for chunk in rest])
            finally:
                await upstream.aclose()
                self.outstanding[url] -= 1
            return Response(content, upstream.status_code, media_type=media, headers=_retry_after(upstream))
        return StreamingResponse(self._chunks(url, upstream, first, rest), media_type=media)

    def _decode_failed(self, failures: list[tuple[str, Exception]]) -> Response:
        """The answer when every decode attempt failed before its first byte: 504 when the last one timed out,
        else 502 naming the unreachable server."""
        url, e = failures[-1]
        if isinstance(e, TimeoutError):
            servers = " nor from ".join(u for u, _ in failures)
            return APIError(504, f"no response byte within {self.config.first_byte_timeout_s:g} s from the decode "
                                 f"server {servers}", "gateway_timeout", None, "first_byte_timeout").response()
        return APIError(502, f"the decode server {url} is unreachable: {_why(e)}", "service_unavailable", None,
                        "decode_unreachable", 1.0).response()

    async def _chunks(self, url: str, upstream: httpx.Response, first: bytes,
                      rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            if first:
                yield first
            async for chunk in rest:
                yield chunk
        finally:
            await upstream.aclose()  # NOTE: a client that left closes the decode leg: the server aborts
            self.outstanding[url] -= 1


def check_body(body: dict[str, Any]) -> APIError | None:
    """The 400 for a body the legs cannot carry, or None: nested deeper than ``MAX_BODY_DEPTH`` (the legs'
    JSON encoder recurses: a body read just below the interpreter's recursion limit failed there), or a
    NaN or an infinity (Python's ``json`` reads ``NaN`` and ``Infinity``; JSON has neither; the server
    refuses them the same way, naming the top-level field). Iterative: no recursion of its own."""
    for key, value in body.items():
        stack = [(value, 2)]
        while stack:
            v, depth = stack.pop()
            if isinstance(v, float) and not math.isfinite(v):
                return APIError(400, f"{key}: Input should be a finite number", "invalid_request_error", key, None)
            if isinstance(v, dict | list) and depth > MAX_BODY_DEPTH:
                return APIError(400, f"the body is not valid JSON: nested too deeply (more than {MAX_BODY_DEPTH} "
                                     "levels)", "invalid_request_error", key, None)
            if isinstance(v, dict):
                stack.extend((x, depth + 1) for x in v.values())
            elif isinstance(v, list):
                stack.extend((x, depth + 1) for x in v)
    return None


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
    async def models(request: Request) -> Response:
        return await proxy.models({k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS})

    @app.get("/backends")
    async def backends() -> JSONResponse:
        return JSONResponse({"prefill": proxy.prefill, "decode": proxy.decode, "outstanding": proxy.outstanding,
                             "health": {u: h.describe() for u, h in proxy.health.items()},
                             "num_direct": proxy.num_direct, "num_disaggregated": proxy.num_disaggregated,
                             "num_prefill_unreachable": proxy.num_prefill_unreachable,
                             "num_first_byte_timeouts": proxy.num_first_byte_timeouts,
                             "num_decode_retries": proxy.num_decode_retries})

    return app


def add_pd_args(parser: argparse.ArgumentParser) -> None:
    """Adds ``--prefill``, ``--decode`` and ``--disagg-min-prompt-tokens`` to ``tandem router``."""
    g = parser.add_argument_group(
        "prefill/decode disaggregation (instead of --backend)",
        "--connect-timeout, --request-timeout, --first-byte-timeout, --failure-threshold and --eject-seconds apply "
        "to both legs: a prefill server that fails (or is silent for --first-byte-timeout) leaves the prefill to "
        "the decode server; a failed decode leg is tried once more on another decode server, else 502 or 504")
    g.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="a prefill server (kv_role kv_producer), e.g. http://127.0.0.1:8100; repeat")
    g.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a decode server (kv_role kv_consumer); repeat")
    g.add_argument("--disagg-min-prompt-tokens", type=int, default=0,
                   help="prompts with fewer tokens go straight to a decode server (default 0: none)")


def pd_config_from_args(args: argparse.Namespace) -> PDConfig:
    return PDConfig(prefill=tuple(args.prefill), decode=tuple(args.decode),
                    min_prompt_tokens=args.disagg_min_prompt_tokens, host=args.host, port=args.port,
                    connect_timeout_s=args.connect_timeout, request_timeout_s=args.request_timeout,
                    first_byte_timeout_s=args.first_byte_timeout, failure_threshold=args.failure_threshold,
                    eject_s=args.eject_seconds, max_eject_s=args.max_eject_seconds)


def cmd_pd_router(args: argparse.Namespace) -> int:
    """``tandem router --prefill ... --decode ...``: serves the P/D proxy until interrupted; prints the
    ``tandem router: listening on ...`` line on stderr once it listens (as ``--backend`` routing does)."""
    from tandem.router.app import serve_router_app

    if args.backend:
        raise ValueError("--backend cannot be combined with --prefill/--decode (P/D routing)")
    proxy = PDProxy(pd_config_from_args(args))
    return serve_router_app(build_pd_app(proxy), args.host, args.port, "warning", lambda: (
        f"P/D: {len(proxy.prefill)} prefill, {len(proxy.decode)} decode servers"))
