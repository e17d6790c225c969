"""`tandem drill`: rehearse the fallback. Steady load goes through the gateway, the candidate is
stopped by a command of the operator's (kill it, block its port), and the drill measures:

- whether the stop worked: the candidate's own URL refuses connections within 5 s;
- fallback time: from the stop command until the start of the first request from which on every
  request was served, successfully, by the primary (`x-tandem-backend`);
- requests lost (failed at the client) before and after the stop, and what became of the streams
  in flight when the stop ran (completed, ended by an error event, failed otherwise);
- continuity: `/metrics` and `/gateway/status` scraped every `scrape_interval_s` — scrape failures,
  the longest gap between good scrapes, whether `tandem_gateway_requests_total` ever went down, and
  whether the gateway's numbered event log has gaps.
The load is `tandem/bench/client.py`'s streaming client (one request per 1/rate seconds).
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tandem.bench.client import BenchConfig, RequestResult, send_request
from tandem.bench.datasets import SampleRequest
from tandem.bench.metrics import summarize
from tandem.gateway.upstream import BACKEND_HEADER


@dataclass(frozen=True)
class DrillConfig:
    """Times in seconds, rate in requests/s. Raises ValueError on non-positive values."""

    gateway: str
    stop_command: str
    model: str | None = None
    api_key: str | None = None
    rate: float = 10.0
    warmup_s: float = 5.0
    observe_s: float = 10.0
    max_tokens: int = 16
    prompt: str = "Once upon a time"
    scrape_interval_s: float = 0.25
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("rate", "warmup_s", "observe_s", "scrape_interval_s", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"drill {name} must be > 0, got {getattr(self, name)}")
        if self.max_tokens < 1:
            raise ValueError(f"drill max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def url(self) -> str:
        return self.gateway.rstrip("/").removesuffix("/v1")


def dry_run_steps(c: DrillConfig) -> list[str]:
    """The steps `run_drill` would take, for --dry-run."""
    return [
        f"1. read {c.url}/gateway/status (backends, weights) and {c.url}/metrics",
        f"2. send {c.rate:g} streaming requests/s of {c.max_tokens} tokens through {c.url}/v1/completions "
        f"for {c.warmup_s:g} s, scraping /metrics and /gateway/status every {c.scrape_interval_s:g} s",
        f"3. run the stop command: {c.stop_command!r}",
        f"4. keep the load for {c.observe_s:g} s more",
        "5. report the fallback time, requests lost, the streams in flight at the stop, metrics and log continuity",
    ]


class Scraper:
    """Polls /metrics and /gateway/status; keeps what the continuity checks need."""

    def __init__(self, client: httpx.AsyncClient, url: str, headers: dict[str, str] | None = None) -> None:
        self.client, self.url, self.headers = client, url, headers or {}
        self.good: list[float] = []
        self.failures = 0
        self.request_totals: list[float] = []
        self.event_seqs: set[int] = set()
        self.events: dict[int, dict[str, Any]] = {}
        self.last_status: dict[str, Any] | None = None

    async def scrape(self) -> None:
        try:
            metrics = (await self.client.get(f"{self.url}/metrics")).raise_for_status().text
            status = await self.client.get(f"{self.url}/gateway/status", headers=self.headers)
            status = status.raise_for_status().json()
        except (httpx.HTTPError, ValueError):
            self.failures += 1
            return
        self.good.append(time.perf_counter())
        total = sum(s.value for f in text_string_to_metric_families(metrics) if f.name == "tandem_gateway_requests"
                    for s in f.samples if s.name.endswith("_total"))
        self.request_totals.append(total)
        for event in status.get("events", []):
            self.events[event["seq"]] = event
        self.last_status = status

    def continuity(self, requests_sent: int) -> dict[str, Any]:
        gaps = [b - a for a, b in zip(self.good, self.good[1:], strict=False)]
        seqs = sorted(self.events)
        missing = [s for s in range(seqs[0], seqs[-1] + 1) if s not in self.events] if seqs else []
        totals = self.request_totals
        return {
            "scrapes_ok": len(self.good), "scrape_failures": self.failures,
            "max_gap_between_scrapes_s": max(gaps) if gaps else None,
            "requests_counter_monotonic": all(b >= a for a, b in zip(totals, totals[1:], strict=False)),
            "requests_counter_increase": (totals[-1] - totals[0]) if totals else None,
            "requests_sent_by_drill": requests_sent, "event_log_gaps": missing,
            "events": [self.events[s] for s in seqs],
        }


def verdict(report: dict[str, Any]) -> tuple[bool, str]:
    """(passed, one sentence): a drill passes when every request ended up served by the primary
    and no client request was lost, those in flight at the stop included (a client whose stream
    broke lost its answer as much as one refused after the stop)."""
    lost, flight = report["requests_lost"], report["in_flight_at_stop"]
    if report["fallback_time_s"] is None:
        return False, f"FAILED: requests were still not all served by the primary at the end; {lost} lost."
    if lost:
        in_flight, after = flight["ended_with_error_event"] + flight["failed_otherwise"], report["after_stop"]["lost"]
        return False, (f"FAILED: {lost} client request(s) lost of {report['requests_total']}: {in_flight} in "
                       f"flight at the stop, {after} started after it, {lost - in_flight - after} ended before it.")
    return True, f"PASSED: fell back in {report['fallback_time_s']:.3f} s, no client request lost."


def fallback_time(results: list[RequestResult], t_stop: float) -> float | None:
    """Seconds from the stop until the start of the first request after it from which on all were
    served by the primary with success (None: that never happened)."""
    after = sorted((r for r in results if r.start_time >= t_stop), key=lambda r: r.start_time)
    recovered_at = None
    for r in after:
        if r.success and r.response_headers.get(BACKEND_HEADER) == "primary":
            recovered_at = recovered_at if recovered_at is not None else r.start_time
        else:
            recovered_at = None
    return None if recovered_at is None else recovered_at - t_stop


def _in_flight(done: list[tuple[RequestResult, float]], t_stop: float) -> dict[str, int]:
    """What became of the requests that had started before the stop and ended after it."""
    out = {"count": 0, "completed": 0, "ended_with_error_event": 0, "failed_otherwise": 0}
    for r, end in done:
        if r.start_time < t_stop < end:
            out["count"] += 1
            if r.success:
                out["completed"] += 1
            elif "server error event" in r.error:
                out["ended_with_error_event"] += 1
            else:
                out["failed_otherwise"] += 1
    return out


def _phase(results: list[RequestResult]) -> dict[str, Any]:
    by_backend: dict[str, int] = {}
    for r in results:
        name = r.response_headers.get(BACKEND_HEADER, "none")
        by_backend[name] = by_backend.get(name, 0) + 1
    ok = [r for r in results if r.success]
    return {"requests": len(results), "lost": len(results) - len(ok), "served_by": by_backend,
            "errors": sorted({r.error_kind for r in results if not r.success}),
            **summarize([r.ttft for r in ok], "ttft", [50, 99]), **summarize([r.latency for r in ok], "e2el", [99])}


async def _load(c: DrillConfig, client: httpx.AsyncClient, bench: BenchConfig, until: list[float],
                done: list[tuple[RequestResult, float]]) -> None:
    """One request every 1/rate s until `until[0]` (perf_counter time, may be moved by the caller)."""
    request = SampleRequest(c.prompt, None, c.max_tokens)

    async def one() -> None:
        result = await send_request(client, bench, request)
        done.append((result, time.perf_counter()))

    tasks = []
    next_at = time.perf_counter()
    while time.perf_counter() < until[0]:
        tasks.append(asyncio.create_task(one()))
        next_at += 1.0 / c.rate
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
    await asyncio.gather(*tasks)


async def _scrape_loop(scraper: Scraper, interval: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await scraper.scrape()
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except TimeoutError:
            pass
    await scraper.scrape()


async def candidate_down_after(client: httpx.AsyncClient, url: str | None, limit_s: float = 5.0) -> float | None:
    """Seconds until the candidate's own URL refuses connections (None: still answering after
    `limit_s`, i.e. the stop command did not stop it, or no candidate URL)."""
    if not url:
        return None
    start = time.perf_counter()
    while time.perf_counter() - start < limit_s:
        try:
            await client.get(f"{url}/v1/models", timeout=1.0)
        except httpx.TransportError:
            return time.perf_counter() - start
        await asyncio.sleep(0.1)
    return None


async def _run(c: DrillConfig) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=c.timeout_s, limits=limits) as client:
        scraper = Scraper(client, c.url, _auth(c))
        await scraper.scrape()
        if scraper.last_status is None:
            await first_model(client, c)  # NOTE: raises the clear error when the key is missing or wrong
            raise ValueError(f"{c.url}/gateway/status did not answer: is it a tandem gateway?")
        before = scraper.last_status
        model = c.model or await first_model(client, c)
        bench = BenchConfig(base_url=c.url, model=model, api_key=c.api_key, timeout=c.timeout_s, disable_tqdm=True)
        done: list[tuple[RequestResult, float]] = []
        start = time.perf_counter()
        until = [start + c.warmup_s + c.observe_s + 3600.0]
        stop_scraping = asyncio.Event()
        scrape_task = asyncio.create_task(_scrape_loop(scraper, c.scrape_interval_s, stop_scraping))
        load_task = asyncio.create_task(_load(c, client, bench, until, done))
        await asyncio.sleep(c.warmup_s)
        t_stop = time.perf_counter()
        proc = await asyncio.create_subprocess_shell(c.stop_command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        output, _ = await proc.communicate()
        stop_took = time.perf_counter() - t_stop
        down = await candidate_down_after(client, (before["backends"].get("candidate") or {}).get("url"))
        until[0] = time.perf_counter() + c.observe_s
        await load_task
        stop_scraping.set()
        await scrape_task
    results = [r for r, _ in done]
    pre = [r for r in results if r.start_time < t_stop]
    post = [r for r in results if r.start_time >= t_stop]
    fb = fallback_time(results, t_stop)
    after = scraper.last_status
    return {
        "gateway": c.url, "stop_command": c.stop_command, "stop_exit_code": proc.returncode,
        "stop_output": output.decode("utf-8", "replace")[-2000:], "stop_command_took_s": stop_took,
        "candidate_down_after_s": down,
        "settings": {"rate": c.rate, "warmup_s": c.warmup_s, "observe_s": c.observe_s, "max_tokens": c.max_tokens},
        "recovered": fb is not None, "fallback_time_s": fb, "passed": None, "verdict": "",
        "requests_total": len(results), "requests_lost": sum(not r.success for r in results),
        "before_stop": _phase(pre), "after_stop": _phase(post), "in_flight_at_stop": _in_flight(done, t_stop),
        "continuity": scraper.continuity(len(results)),
        "gateway_before": {"canary": before["canary"]["weights"], "breakers": _breakers(before)},
        "gateway_after": {"canary": after["canary"]["weights"], "breakers": _breakers(after),
                          "rolled_back": after["canary"]["rolled_back"]},
    }


async def first_model(client: httpx.AsyncClient, c: DrillConfig) -> str:
    """The first model id of the gateway's /v1/models. Raises ValueError when the gateway refuses
    the key (401/403: pass --api-key) or answers anything but a model list."""
    r = await client.get(f"{c.url}/v1/models", headers=_auth(c))
    if r.status_code in (401, 403):
        hint = "the key given by --api-key was refused" if c.api_key else "it needs a key: pass --api-key"
        raise ValueError(f"{c.url}/v1/models answered {r.status_code}: {hint} (or $TANDEM_GATEWAY_API_KEY)")
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"{c.url}/v1/models answered {r.status_code} without a model list; pass --model") from e


def _auth(c: DrillConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {c.api_key}"} if c.api_key else {}


def _breakers(status: dict[str, Any]) -> dict[str, str]:
    return {name: b["breaker"]["state"] for name, b in status["backends"].items()}


def run_drill(c: DrillConfig) -> dict[str, Any]:
    """Runs the drill (blocking) and returns its report document, `passed` / `verdict` set by
    `verdict`. Raises ValueError when the URL is not a tandem gateway, httpx.HTTPError when it
    cannot be reached."""
    report = asyncio.run(_run(c))
    report["passed"], report["verdict"] = verdict(report)
    return report


def drill_markdown(r: dict[str, Any]) -> str:
    """The Markdown page of a drill report."""
    fb = "never (not every request was served by the primary by the end)" if r["fallback_time_s"] is None \
        else f"{r['fallback_time_s']:.3f} s"
    cont, flight = r["continuity"], r["in_flight_at_stop"]
    lines = [
        f"# tandem drill: {r['gateway']}", "",
        f"Stop command `{r['stop_command']}` (exit {r['stop_exit_code']}, took {r['stop_command_took_s']:.3f} s); "
        + ("the candidate's URL refused connections "
           f"{r['candidate_down_after_s']:.3f} s after it." if r["candidate_down_after_s"] is not None else
           "WARNING: the candidate's URL still answered 5 s after it (the command did not stop it)."), "",
        f"**{r['verdict']}**", "",
        f"Fallback time: {fb}. Requests lost: {r['requests_lost']} of {r['requests_total']}.", "",
        "(Fallback time: from the stop to the start of the first request from which on every request was "
        "served by the primary with success; requests start one per 1/rate s, so that is its resolution. "
        "Requests in flight at the stop are counted below, not in it.)", "",
        "| phase | requests | lost | served by | median TTFT ms | p99 E2EL ms |", "|---|---|---|---|---|---|",
    ]
    for name in ("before_stop", "after_stop"):
        p = r[name]
        ttft, e2el = p["median_ttft_ms"], p["p99_e2el_ms"]
        lines.append(f"| {name} | {p['requests']} | {p['lost']} | {p['served_by']} | "
                     f"{'n/a' if ttft is None else f'{ttft:.1f}'} | {'n/a' if e2el is None else f'{e2el:.1f}'} |")
    lines += [
        "", f"Streams in flight at the stop: {flight['count']} (completed {flight['completed']}, ended with an "
        f"error event {flight['ended_with_error_event']}, failed otherwise {flight['failed_otherwise']}).", "",
        f"Continuity: {cont['scrapes_ok']} good scrapes, {cont['scrape_failures']} failed, longest gap "
        f"{cont['max_gap_between_scrapes_s'] or 0:.3f} s; requests counter monotonic: "
        f"{cont['requests_counter_monotonic']}; event log gaps: {cont['event_log_gaps'] or 'none'}.", "",
        f"Gateway before: {r['gateway_before']}; after: {r['gateway_after']}.", "",
        "| seq | kind | message |", "|---|---|---|",
    ]
    lines += [f"| {e['seq']} | {e['kind']} | {e['message']} |" for e in cont["events"]]
    return "\n".join(lines) + "\n"
