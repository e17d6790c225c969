"""Load generator for any OpenAI-compatible server: streaming requests, arrivals, concurrency.

Timing follows `vllm bench serve` (vllm/benchmarks/lib/endpoint_request_func.py), measured on the
client with `time.perf_counter()`:
- start: just before the HTTP request is sent (after the concurrency semaphore is acquired);
- TTFT: start -> first SSE chunk that carries a choice (a chat chunk holding only the assistant
  role header is skipped: some servers send it before any token is computed);
- ITL: gaps between consecutive such chunks;
- E2EL: start -> the last such chunk (the trailing usage chunk and `[DONE]` are not tokens).
Arrivals: inter-arrival gaps are Gamma(shape=burstiness, scale=1/(rate*burstiness)), so the mean
rate is `rate` and burstiness 1.0 is a Poisson process; as in vLLM the cumulative schedule is
rescaled so that the last request leaves at exactly num_requests / rate seconds.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from tandem.bench.datasets import SampleRequest
from tandem.bench.memory import MemorySampler
from tandem.bench.spec_metrics import scrape_spec_counters, spec_decode_delta

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class BenchConfig:
    """How to send the load. Times in seconds, rates in requests/s.

    Raises ValueError from __post_init__ on an unknown endpoint or a non-positive rate,
    burstiness, concurrency or timeout.
    """

    base_url: str
    model: str
    endpoint: str = "completions"
    api_key: str | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = False
    temperature: float | None = 0.0
    timeout: float = 600.0
    num_warmups: int = 0
    disable_tqdm: bool = False
    server_pid: int | None = None

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {self.endpoint!r}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout}")

    @property
    def api_url(self) -> str:
        """Full URL of the chosen endpoint; a trailing `/v1` on base_url is tolerated."""
        base = self.base_url.rstrip("/").removesuffix("/v1")
        return base + ENDPOINTS[self.endpoint]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestResult:
    """Outcome of one request. Times in seconds (perf_counter clock).

    error_kind: None on success, else `timeout`, `http_<status>`, `connection_error` (no response
    received) or `malformed_stream` (bad JSON, a stream cut before `[DONE]`, or no token chunk).
    output_tokens: `usage.completion_tokens` from the server, None if it sent no usage.
    response_headers: the answer's HTTP headers (lower-case names; empty without an answer), e.g.
    the `x-tandem-backend` a `tandem gateway` sets.
    """

    success: bool = False
    error_kind: str | None = None
    error: str = ""
    prompt_len: int | None = None
    output_tokens: int | None = None
    generated_text: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start_time: float = 0.0
    response_headers: dict[str, str] = field(default_factory=dict)

    def fail(self, kind: str, message: str) -> RequestResult:
        """Mark this result failed (mutates and returns self)."""
        self.success, self.error_kind, self.error = False, kind, message[:500]
        return self


@dataclass
class BenchRun:
    """Everything one benchmark run measured: per-request results in input order, wall time
    from the first arrival to the last completion (seconds), the server's peak RSS (bytes,
    None without --server-pid), and the speculative-decoding figures of the timed run
    (`spec_metrics.spec_decode_delta`; None when the server does not expose them)."""

    results: list[RequestResult]
    duration_s: float
    peak_rss_bytes: int | None = None
    spec_decode: dict[str, Any] | None = None


def build_payload(config: BenchConfig, request: SampleRequest) -> dict[str, Any]:
    """JSON body for one streaming request (OpenAI fields plus vLLM's `ignore_eos`)."""
    payload: dict[str, Any] = {
        "model": config.model,
        "max_tokens": request.expected_output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": request.prompt}]
        # NOTE: newer servers read max_completion_tokens, older ones only max_tokens; send both.
        payload["max_completion_tokens"] = request.expected_output_len
    else:
        payload["prompt"] = request.prompt
    if config.temperature is not None:
        payload["temperature"] = config.temperature
    if config.ignore_eos:
        payload["ignore_eos"] = True
    return payload


def _chunk_text(choice: dict[str, Any], chat: bool) -> str | None:
    """Text of one streamed choice; None for a chat role-only header (not a token)."""
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    text = delta.get("content") or delta.get("reasoning_content") or ""
    if not text and "role" in delta and choice.get("finish_reason") is None:
        return None
    return text


async def _read_stream(response: httpx.Response, result: RequestResult, chat: bool) -> None:
    """Consume an SSE body, filling timing, text and usage into `result` (mutated).

    Raises ValueError on a malformed event; transport errors propagate.
    """
    last = result.start_time
    got_token = finished = done = False
    async for raw in response.aiter_lines():
        line = raw.strip()
        if not line or line.startswith(":") or not line.startswith("data:"):
            continue  # blank separators, SSE comments (pings), event:/id: fields
        data = line[5:].strip()
        if data == "[DONE]":
            # NOTE: read on to the end of the body (not break) so httpx can reuse the keep-alive
            # connection, as vLLM's client does; otherwise every request pays a new connection.
            done = True
            continue
        now = time.perf_counter()
        event = json.loads(data)
        if not isinstance(event, dict):
            raise ValueError(f"SSE data is not a JSON object: {data[:80]}")
        if "error" in event and not event.get("choices"):
            raise ValueError(f"server error event: {json.dumps(event['error'])[:200]}")
        for choice in event.get("choices") or []:
            finished = finished or choice.get("finish_reason") is not None
        choices = event.get("choices") or []
        text = _chunk_text(choices[0], chat) if choices else None
        if text is not None:
            if got_token:
                result.itl.append(now - last)
            else:
                result.ttft, got_token = now - result.start_time, True
            last = now
            result.generated_text += text
        usage = event.get("usage")
        if usage:
            result.output_tokens = usage.get("completion_tokens", result.output_tokens)
            result.prompt_len = usage.get("prompt_tokens") or result.prompt_len
    if not got_token:
        raise ValueError("stream carried no token chunk")
    if not (done or finished):
        raise ValueError("stream ended before [DONE] and without a finish_reason")
    result.latency = last - result.start_time
    result.success = True


async def send_request(
    client: httpx.AsyncClient, config: BenchConfig, request: SampleRequest
) -> RequestResult:
    """Send one streaming request and time it; never raises for server or network faults
    (they become `RequestResult.error_kind`), so a run goes on past failures."""
    result = RequestResult(prompt_len=request.prompt_len)
    payload = build_payload(config, request)
    answered = False
    result.start_time = time.perf_counter()
    try:
        async with asyncio.timeout(config.timeout):
            async with client.stream(
                "POST", config.api_url, json=payload, headers=config.headers
            ) as response:
                answered = True
                result.response_headers = dict(response.headers)
                if response.status_code != 200:
                    body = (await response.aread()).decode("utf-8", "replace")
                    return result.fail(f"http_{response.status_code}", body)
                await _read_stream(response, result, config.endpoint == "chat")
    except (TimeoutError, httpx.TimeoutException) as e:
        return result.fail("timeout", f"no complete answer within {config.timeout} s: {e!r}")
    except httpx.RequestError as e:  # transport faults, undecodable bodies
        kind = "malformed_stream" if answered else "connection_error"
        return result.fail(kind, repr(e))
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        # NOTE: json.JSONDecodeError is a ValueError; the others come from JSON of the wrong shape.
        return result.fail("malformed_stream", repr(e))
    return result


def arrival_offsets(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send time of each request, seconds after the run starts (non-decreasing, first > 0 unless
    the rate is infinite). Gamma inter-arrivals as in vLLM's `get_request`; see module docstring."""
    if math.isinf(request_rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    offsets = np.cumsum(gaps)
    if n and offsets[-1] > 0:
        offsets *= (n / request_rate) / offsets[-1]
    return offsets.tolist()


async def _run_async(config: BenchConfig, requests: list[SampleRequest]) -> BenchRun:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(config.timeout)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        sem = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None

        async def limited(req: SampleRequest) -> RequestResult:
            if sem is None:
                return await send_request(client, config, req)
            async with sem:
                return await send_request(client, config, req)

        # NOTE: warm-ups go out together (within the concurrency cap) so that they also open the
        # keep-alive connections the timed run reuses; their results are discarded.
        await asyncio.gather(*(limited(requests[i % len(requests)]) for i in range(config.num_warmups)))
        bar = tqdm(total=len(requests), disable=config.disable_tqdm, desc="bench", unit="req")

        async def one(req: SampleRequest) -> RequestResult:
            res = await limited(req)
            bar.update(1)
            return res

        offsets = arrival_offsets(len(requests), config.request_rate, config.burstiness, config.seed)
        # NOTE: scraped after the warm-ups and outside the timed window, so the counters' increase
        # is the timed requests' own and the scrapes cost the measured run nothing.
        spec_before = await scrape_spec_counters(client, config.base_url, config.headers)
        start = time.perf_counter()
        tasks = []
        for req, offset in zip(requests, offsets, strict=True):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
        spec_after = await scrape_spec_counters(client, config.base_url, config.headers)
    return BenchRun(results=list(results), duration_s=duration,
                    spec_decode=spec_decode_delta(spec_before, spec_after))


def run_benchmark(config: BenchConfig, requests: list[SampleRequest]) -> BenchRun:
    """Send `requests` with the configured arrivals and concurrency; block until all finish.

    Samples the server's RSS during the run when `config.server_pid` is set.
    Raises ValueError on an empty request list or a server_pid naming no process.
    """
    if not requests:
        raise ValueError("no requests to send")
    sampler = MemorySampler(config.server_pid) if config.server_pid else None
    if sampler:
        sampler.start()
    try:
        run = asyncio.run(_run_async(config, requests))
    finally:
        if sampler:
            sampler.stop()
    run.peak_rss_bytes = sampler.peak_bytes if sampler else None
    return run


def fetch_models(base_url: str, api_key: str | None = None, timeout: float = 30.0) -> list[dict[str, Any]]:
    """The model cards of the server's `GET /v1/models` (`id`, and for vLLM/Tandem `root`: the
    path or repo the model was loaded from).

    Raises httpx.HTTPError when the server is unreachable or answers an error, ValueError when
    the list is empty or not a list of objects with an `id`.
    """
    base = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(base + "/v1/models", headers=headers, timeout=timeout)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base}/v1/models lists no model; pass --model")
    if not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in models):
        raise ValueError(f"{base}/v1/models: malformed model list")
    return models


def fetch_model_id(base_url: str, api_key: str | None = None, timeout: float = 30.0) -> str:
    """First model id listed by the server's `GET /v1/models` (errors as `fetch_models`)."""
    return fetch_models(base_url, api_key, timeout)[0]["id"]
