"""The serving half of ``disagg_bench.py``: co-located vs disaggregated at equal cores, short chat streams
with and without long prompts (Poisson arrivals), TTFT / ITL percentiles and DistServe's goodput.

Each set-up is started, measured at every load and stopped before the next one starts, so the two never
share the cores. Requests go through Tandem's bench client (``tandem/bench/client.py``: streaming
completions, ``ignore_eos``, greedy); every prompt starts with its own number, so no request hits another's
prefix cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tandem.bench.client import BenchConfig, RequestResult, send_request
from tandem.bench.datasets import SampleRequest
from tandem.bench.metrics import request_tpot, summarize
from tandem.disagg.launch import free_port, wait_healthy
from tandem.models.resolve import resolve_model_path

ROOT = Path(__file__).resolve().parents[1]
FILLER = ("The quick brown fox jumps over the lazy dog while the farmer counts his sheep near the old mill. ")
PERCENTILES = [50.0, 99.0]


def add_serving_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("serving comparison")
    g.add_argument("--no-serving", action="store_true", help="measure the transfer only")
    g.add_argument("--long-tokens", type=int, default=2000, help="tokens of each long prompt")
    g.add_argument("--short-tokens", type=int, default=48, help="tokens of each short chat prompt")
    g.add_argument("--output-tokens", type=int, default=48, help="tokens generated per request")
    g.add_argument("--short-rate", type=float, default=0.5, help="short requests per second at scale 1")
    g.add_argument("--long-rate", type=float, default=0.05, help="long prompts per second at scale 1")
    g.add_argument("--scales", default="0.5,1,2", help="multiples of both rates for the goodput sweep")
    g.add_argument("--window-s", type=float, default=60.0, help="seconds of arrivals per run")
    g.add_argument("--slo-ttft-ms", type=float, default=10000.0)
    g.add_argument("--slo-tpot-ms", type=float, default=250.0)
    g.add_argument("--min-prompt-tokens", type=int, default=256,
                   help="the P/D router's --disagg-min-prompt-tokens (short prompts straight to decode)")


def serve_cmd(model: Path, dtype: str, port: int, cpus: str, threads: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tandem.cli", "serve", "--model", str(model), "--dtype", dtype, "--port",
            str(port), "--cpu-bind", cpus, "--num-threads", str(threads), *extra]


def start_setup(name: str, model: Path, args: argparse.Namespace, logs: Path) -> tuple[str, list[subprocess.Popen]]:
    """Starts one set-up; returns its URL and processes. ``colocated``: one server on cores 0,1;
    ``disaggregated``: a prefill server on core 0, a decode server on core 1, the P/D router."""
    def spawn(cmd: list[str], log: str) -> subprocess.Popen:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(logs / log, "w"))  # noqa: SIM115

    procs: list[subprocess.Popen] = []
    try:
        return _start(name, model, args, spawn, procs)
    except BaseException:
        stop(procs)  # NOTE: an interrupted start-up must not leave servers behind
        raise


def _start(name: str, model: Path, args: argparse.Namespace, spawn: Any, procs: list[subprocess.Popen]
           ) -> tuple[str, list[subprocess.Popen]]:
    if name == "colocated":
        port = free_port()
        procs.append(spawn(serve_cmd(model, args.dtype, port, "0,1", 2), "colocated.log"))
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, procs[0])
        return url, procs
    p_port, d_port, port = free_port(), free_port(), free_port()
    kv = {"kv_connector": "TandemConnector", "kv_port": free_port()}
    procs += [spawn(serve_cmd(model, args.dtype, p_port, "0", 1, "--kv-transfer-config",
                              json.dumps({**kv, "kv_role": "kv_producer"})), "prefill.log"),
              spawn(serve_cmd(model, args.dtype, d_port, "1", 1, "--kv-transfer-config",
                              json.dumps({**kv, "kv_port": free_port(), "kv_role": "kv_consumer"})), "decode.log")]
    for p, proc in zip((p_port, d_port), procs, strict=True):
        wait_healthy(f"http://127.0.0.1:{p}", proc)
    procs.append(spawn([sys.executable, "-m", "tandem.cli", "router", "--prefill", f"http://127.0.0.1:{p_port}",
                        "--decode", f"http://127.0.0.1:{d_port}", "--port", str(port),
                        "--disagg-min-prompt-tokens", str(args.min_prompt_tokens)], "router.log"))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, procs[-1])
    return url, procs


def stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        p.terminate()
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


def make_prompt(tokenizer: Any, i: int, num_tokens: int) -> str:
    ids = tokenizer(f"Request {i}. " + FILLER * (num_tokens // 15 + 2), add_special_tokens=False).input_ids
    return tokenizer.decode(ids[:num_tokens])


def poisson(rate: float, window_s: float, rng: np.random.Generator) -> list[float]:
    if rate <= 0:
        return []
    times, t = [], rng.exponential(1 / rate)
    while t < window_s:
        times.append(t)
        t += rng.exponential(1 / rate)
    return times


async def one_load(url: str, model_id: str, schedule: list[tuple[float, str, SampleRequest]],
                   timeout_s: float) -> list[tuple[str, RequestResult]]:
    config = BenchConfig(base_url=url, model=model_id, ignore_eos=True, temperature=0.0, timeout=timeout_s)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s)) as client:
        start = time.perf_counter()

        async def at(offset: float, kind: str, req: SampleRequest) -> tuple[str, RequestResult]:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            return kind, await send_request(client, config, req)

        return list(await asyncio.gather(*(at(o, k, r) for o, k, r in schedule)))


def report(results: list[tuple[str, RequestResult]], args: argparse.Namespace, window_s: float) -> dict[str, Any]:
    """Latency percentiles (ms) of short streams and of all requests, SLO attainment, the request rate."""
    ok = [(k, r) for k, r in results if r.success]
    out: dict[str, Any] = {"requests": len(results), "failed": len(results) - len(ok),
                           "num_long": sum(k == "long" for k, _ in results),
                           "request_rate": round(len(results) / window_s, 4)}
    for label, rows in (("short", [r for k, r in ok if k == "short"]), ("all", [r for _, r in ok])):
        for name, values in (("ttft", [r.ttft for r in rows]), ("itl", [x for r in rows for x in r.itl])):
            stats = summarize(values, name, PERCENTILES)
            out.update({f"{label}_{key}": round(v, 1) for key, v in stats.items()
                        if v is not None and key.split("_")[0] in ("p50", "p99")})
    good = sum(r.ttft * 1000 <= args.slo_ttft_ms
               and (request_tpot(r, args.output_tokens) or 0.0) * 1000 <= args.slo_tpot_ms for _, r in ok)
    out["slo_attainment"] = round(good / len(results), 3) if results else None
    # NOTE: per request (kind, TTFT ms, TPOT ms; None when it failed), so goodput can be recomputed for other SLOs
    out["per_request"] = [(k, round(r.ttft * 1000, 1), round((request_tpot(r, args.output_tokens) or 0.0) * 1000, 1))
                          if r.success else (k, None, None) for k, r in results]
    return out


def run_setup(name: str, model: Path, args: argparse.Namespace, tokenizer: Any, logs: Path) -> dict[str, Any]:
    url, procs = start_setup(name, model, args, logs)
    try:
        model_id = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        runs: dict[str, Any] = {}
        counter = 0
        loads = [("no_long", 1.0, 0.0)] + [(f"mix_x{s:g}", s, s) for s in map(float, args.scales.split(","))]
        for label, short_scale, long_scale in loads:
            schedule = []
            for seed, kind, rate, tokens in ((0, "short", args.short_rate * short_scale, args.short_tokens),
                                             (1, "long", args.long_rate * long_scale, args.long_tokens)):
                for t in poisson(rate, args.window_s, np.random.default_rng(seed)):
                    counter += 1
                    schedule.append((t, kind, SampleRequest(make_prompt(tokenizer, counter, tokens), tokens,
                                                            args.output_tokens)))
            t0 = time.perf_counter()
            results = asyncio.run(one_load(url, model_id, schedule, timeout_s=600.0))
            runs[label] = {**report(results, args, args.window_s), "wall_s": round(time.perf_counter() - t0, 1),
                           "loadavg": [round(x, 2) for x in os.getloadavg()]}
            print(name, label, json.dumps({k: v for k, v in runs[label].items() if k != "per_request"}), flush=True)
        return runs
    finally:
        stop(procs)


def goodput(runs: dict[str, Any]) -> float:
    """DistServe's goodput: the highest request rate among the long-prompt mix runs whose SLO attainment is
    >= 90% (the run without long prompts is the ITL baseline, not a point of the sweep)."""
    rates = [r["request_rate"] for label, r in runs.items()
             if label != "no_long" and (r["slo_attainment"] or 0) >= 0.9]
    return max(rates) if rates else 0.0


def run_serving(args: argparse.Namespace) -> dict[str, Any]:
    """Both set-ups, one after the other; returns their runs, goodput and the ITL p99 ratios."""
    from transformers import AutoTokenizer

    model = resolve_model_path(None if args.model == "default" else args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"disagg-bench-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms, "logs": str(logs)}
    for name in ("disaggregated", "colocated"):
        runs = run_setup(name, model, args, tokenizer, logs)
        base = runs["no_long"].get("short_p99_itl_ms")
        ratios = {label: round(r["short_p99_itl_ms"] / base, 2) for label, r in runs.items()
                  if label != "no_long" and base and r.get("short_p99_itl_ms") is not None}
        out[name] = {"runs": runs, "goodput_req_s": goodput(runs), "short_itl_p99_vs_no_long": ratios}
    return out


if __name__ == "__main__":
    print("run benchmarks/disagg_bench.py (this module is its serving half)", file=sys.stderr)
    sys.exit(2)
