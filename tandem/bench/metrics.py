"""Serving metrics with the definitions of `vllm bench serve` (vllm/benchmarks/serve.py,
`calculate_metrics`), so numbers from Tandem's client and vLLM's client mean the same thing.

Per successful request: TTFT, E2EL, and TPOT = (E2EL - TTFT) / (output_tokens - 1) when it
produced more than one token. ITL gaps are pooled over all requests. Throughputs divide by the
run's wall time: request (completed/s), output tokens/s, total (input + output) tokens/s, and
goodput (requests/s meeting every SLO; a one-token request has TPOT 0 for the SLO check). Each
latency gets mean, median, std (population) and the chosen percentiles (numpy linear
interpolation), reported in milliseconds. A latency with no sample (no successful request, or no
request of more than one token for TPOT/ITL) is None (JSON null), not vLLM's 0: a run in which
everything failed must not look infinitely fast to `tandem bench compare`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tandem.bench.client import RequestResult

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


def parse_goodput(spec: str | None) -> dict[str, float]:
    """Parse `ttft:MS,tpot:MS,e2el:MS` (any subset) into {name: milliseconds}.

    Raises ValueError on an unknown name, a missing colon, or a negative/non-numeric value.
    """
    if not spec:
        return {}
    slos: dict[str, float] = {}
    for item in spec.replace(" ", ",").split(","):
        if not item:
            continue
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"bad goodput item {item!r}: use {','.join(m + ':MS' for m in GOODPUT_METRICS)}")
        ms = float(value)
        if ms < 0:
            raise ValueError(f"goodput SLO must be >= 0 ms, got {item!r}")
        slos[name] = ms
    return slos


def parse_percentiles(spec: str) -> list[float]:
    """Parse `50,90,99` into [50.0, 90.0, 99.0]. Raises ValueError outside [0, 100]."""
    values = [float(p) for p in spec.split(",") if p.strip()]
    for p in values:
        if not 0.0 <= p <= 100.0:
            raise ValueError(f"percentile must be in [0, 100], got {p}")
    return values


def percentile_key(p: float) -> str:
    """`p99`, `p99.9`: the key suffix vLLM uses in saved results."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def summarize(values_s: list[float], name: str, percentiles: list[float]) -> dict[str, float | None]:
    """mean/median/std/percentiles of `values_s` (seconds) as `{stat}_{name}_ms` keys; every value
    is None when `values_s` is empty."""
    if not values_s:
        keys = ["mean", "median", "std", *(percentile_key(p) for p in percentiles)]
        return {f"{key}_{name}_ms": None for key in keys}
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    out: dict[str, float | None] = {
        f"mean_{name}_ms": float(np.mean(arr)),
        f"median_{name}_ms": float(np.median(arr)),
        f"std_{name}_ms": float(np.std(arr)),
    }
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(arr, p))
    return out


_OOM_MARKERS = ("out of memory", "outofmemory", "memoryerror", "cannot allocate memory", "oom-kill")


def is_oom(result: RequestResult) -> bool:
    """A failure whose error text says memory ran out (a server's 5xx body or a killed stream)."""
    return not result.success and any(m in result.error.lower() for m in _OOM_MARKERS)


def output_token_count(result: RequestResult, tokenizer: Any | None) -> int:
    """Tokens a successful request produced: the server's `usage.completion_tokens`; else the
    generated text re-tokenized without special tokens; else (no tokenizer) the number of
    streamed token chunks, which undercounts when a server bundles several tokens per chunk."""
    if result.output_tokens:
        return int(result.output_tokens)
    if tokenizer is not None:
        return len(tokenizer(result.generated_text, add_special_tokens=False).input_ids)
    return 1 + len(result.itl)


def request_tpot(result: RequestResult, output_len: int) -> float | None:
    """(E2EL - TTFT) / (output_len - 1) in seconds, or None for output_len <= 1."""
    if output_len <= 1:
        return None
    return (result.latency - result.ttft) / (output_len - 1)


def count_good(ttfts: list[float], tpots: list[float], e2els: list[float], slos_ms: dict[str, float]) -> int:
    """Requests whose every chosen metric (seconds) is at or under its SLO (milliseconds)."""
    columns = {"ttft": ttfts, "tpot": tpots, "e2el": e2els}
    chosen = [(columns[name], ms / 1000.0) for name, ms in slos_ms.items()]
    return sum(all(col[i] <= slo for col, slo in chosen) for i in range(len(ttfts)))


@dataclass
class _Columns:
    """Per-request values of successful requests (seconds), plus token counts of all requests."""

    input_lens: list[int] = field(default_factory=list)
    output_lens: list[int] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    e2els: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    tpots: list[float] = field(default_factory=list)  # requests with > 1 output token
    all_tpots: list[float] = field(default_factory=list)  # every success; 0 for one token


def _columns(results: list[RequestResult], tokenizer: Any | None) -> _Columns:
    cols = _Columns()
    for r in results:
        cols.input_lens.append(r.prompt_len or 0)
        if not r.success:
            cols.output_lens.append(0)
            continue
        n_out = output_token_count(r, tokenizer)
        cols.output_lens.append(n_out)
        tpot = request_tpot(r, n_out)
        if tpot is not None:
            cols.tpots.append(tpot)
        cols.all_tpots.append(tpot or 0.0)
        cols.ttfts.append(r.ttft)
        cols.e2els.append(r.latency)
        cols.itls.extend(r.itl)
    return cols


def calculate_metrics(
    results: list[RequestResult],
    duration_s: float,
    percentiles: list[float],
    goodput_ms: dict[str, float] | None = None,
    tokenizer: Any | None = None,
) -> dict[str, Any]:
    """Aggregate metrics of one run as a flat dict with vLLM's saved-result key names.

    Counts and token totals are integers; throughputs are per second of `duration_s`; latencies
    in ms (None without samples, see the module docstring); `success_rate` is completed / sent
    (None for no request); `timeouts` and `ooms` count those failures (`is_oom`). Per-request
    lists (seconds, input order, None for failures) are kept for CDF plots. `failures` maps each
    error kind to its count. Raises ValueError if duration_s <= 0.
    """
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0 s, got {duration_s}")
    cols = _columns(results, tokenizer)
    completed = len(cols.ttfts)
    total_input = sum(n for n, r in zip(cols.input_lens, results, strict=True) if r.success)
    total_output = sum(cols.output_lens)
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": completed,
        "failed": len(results) - completed,
        "success_rate": completed / len(results) if results else None,
        "failures": dict(Counter(r.error_kind for r in results if not r.success)),
        "timeouts": sum(r.error_kind == "timeout" for r in results),
        "ooms": sum(is_oom(r) for r in results),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration_s,
        "request_goodput": None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    if goodput_ms:
        out["good_completed"] = count_good(cols.ttfts, cols.all_tpots, cols.e2els, goodput_ms)
        out["request_goodput"] = out["good_completed"] / duration_s
    for name, values in (("ttft", cols.ttfts), ("tpot", cols.tpots), ("itl", cols.itls), ("e2el", cols.e2els)):
        out.update(summarize(values, name, percentiles))
    out.update(
        input_lens=cols.input_lens,
        output_lens=cols.output_lens,
        ttfts=[r.ttft if r.success else None for r in results],
        e2els=[r.latency if r.success else None for r in results],
        itls=[r.itl for r in results],
        errors=[r.error for r in results],
        error_kinds=[r.error_kind for r in results],
    )
    return out
