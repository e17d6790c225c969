"""The primary's latency through ``tandem gateway`` with shadowing off and on, beside the noise.

Usage:
    PYTHONPATH=$PWD python benchmarks/gateway_shadow_bench.py [--model DIR] [--rounds 5]
        [--requests 20] [--max-tokens 8] [--candidate-delay 0.05] [--work-dir DIR]

Starts ``tandem serve`` of ``--model`` (default: the stories260K parity fixture in ../shared) as
the primary, a scripted candidate that answers every request with 3 SSE chunks ``--candidate-delay``
seconds apart (it sleeps, so it takes no CPU from the primary: the figure is the gateway's own cost
of shadowing, not two models fighting over the same cores), and two ``tandem gateway`` processes in
front of them: ``off`` (``--shadow-fraction 0``) and ``on`` (``--shadow-fraction 1``, every request
also sent to the candidate, up to the default 4 legs at once). Each round sends ``--requests``
sequential streaming greedy requests through off, on and off again, the order rotated per round;
the second off is the noise baseline (Diffy's idea applied to latency). Reported: median and p90
TTFT and end-to-end latency per gateway (ms), on/off and off-again/off ratios of the medians, the
shadow legs that ran (the on gateway's /gateway/status), and the load average at the start and end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tandem.bench.client import BenchConfig, send_request
from tandem.bench.datasets import SampleRequest

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO.parent / "shared" / "models" / "stories260K" / "hf"


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_candidate(port: int, delay_s: float) -> None:
    """The scripted candidate: 3 completion chunks `delay_s` apart, then [DONE]."""
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()

        async def events():
            for i, text in enumerate(["Once", " upon", " a time"]):
                await asyncio.sleep(delay_s)
                chunk = {"id": "c", "object": "text_completion", "created": 0, "model": body.get("model"),
                         "choices": [{"index": 0, "text": text, "logprobs": None,
                                      "finish_reason": "length" if i == 2 else None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error")


def _start(name: str, cmd: list[str], work: Path) -> subprocess.Popen:
    log = open(work / f"{name}.log", "w")  # noqa: SIM115 - the child keeps it
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(url: str, proc: subprocess.Popen, path: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited ({proc.returncode})")
        try:
            httpx.get(f"{url}{path}", timeout=2)
            return
        except httpx.HTTPError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer in {timeout_s} s")


async def _round(urls: dict[str, str], order: list[str], n: int, max_tokens: int) -> dict[str, list]:
    out: dict[str, list] = {name: [] for name in order}
    async with httpx.AsyncClient(timeout=60) as client:
        for name in order:
            config = BenchConfig(base_url=urls[name.split("#")[0]], model="stories", disable_tqdm=True)
            for _ in range(n):
                r = await send_request(client, config, SampleRequest("Once upon a time", None, max_tokens))
                if not r.success:
                    raise RuntimeError(f"{name}: {r.error_kind}: {r.error}")
                out[name].append((r.ttft, r.latency))
    return out


def _summary(samples: list[tuple[float, float]]) -> dict[str, float]:
    ttft, e2el = sorted(s[0] for s in samples), sorted(s[1] for s in samples)
    p90 = max(0, int(0.9 * len(ttft)) - 1)
    return {"median_ttft_ms": statistics.median(ttft) * 1e3, "p90_ttft_ms": ttft[p90] * 1e3,
            "median_e2el_ms": statistics.median(e2el) * 1e3, "p90_e2el_ms": e2el[p90] * 1e3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(STORIES))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--candidate-delay", type=float, default=0.05)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--serve-candidate", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_candidate is not None:
        serve_candidate(args.serve_candidate, args.candidate_delay)
        return 0
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gateway-shadow-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    ports = {k: _port() for k in ("primary", "candidate", "off", "on")}
    url = {k: f"http://127.0.0.1:{v}" for k, v in ports.items()}
    tandem = [sys.executable, "-m", "tandem.cli"]
    procs = {
        "primary": _start("primary", tandem + ["serve", "--model", args.model, "--served-model-name", "stories",
                                               "--port", str(ports["primary"])], work),
        "candidate": _start("candidate", [sys.executable, __file__, "--serve-candidate", str(ports["candidate"]),
                                          "--candidate-delay", str(args.candidate_delay)], work),
    }
    for side, fraction in (("off", "0"), ("on", "1")):
        procs[side] = _start(side, tandem + ["gateway", "--primary", url["primary"], "--candidate", url["candidate"],
                                             "--shadow-fraction", fraction, "--port", str(ports[side])], work)
    try:
        for name, path in (("primary", "/health"), ("candidate", "/docs"), ("off", "/health"), ("on", "/health")):
            _wait(url[name], procs[name], path)
        asyncio.run(_round(url, ["off", "on"], 5, args.max_tokens))  # warm-up
        names = ["off", "on", "off#again"]
        samples: dict[str, list] = {n: [] for n in names}
        per_round: list[dict[str, dict[str, float]]] = []
        for i in range(args.rounds):
            order = names[i % 3:] + names[:i % 3]
            got = asyncio.run(_round(url, order, args.requests, args.max_tokens))
            per_round.append({name: _summary(s) for name, s in got.items()})
            for name, s in got.items():
                samples[name] += s
        shadow = httpx.get(f"{url['on']}/gateway/status", timeout=5).json()["shadow"]
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(30)
    table = {n: _summary(s) for n, s in samples.items()}
    print(f"{'gateway':<10} {'median TTFT':>12} {'p90 TTFT':>10} {'median E2EL':>12} {'p90 E2EL':>10}  (ms)")
    for n, t in table.items():
        print(f"{n:<10} {t['median_ttft_ms']:>12.2f} {t['p90_ttft_ms']:>10.2f} {t['median_e2el_ms']:>12.2f} "
              f"{t['p90_e2el_ms']:>10.2f}")
    for key in ("median_ttft_ms", "median_e2el_ms"):
        rounds = [(r["on"][key] / r["off"][key], r["off#again"][key] / r["off"][key]) for r in per_round]
        print(f"{key}: on/off {table['on'][key] / table['off'][key]:.3f}, "
              f"off-again/off (noise) {table['off#again'][key] / table['off'][key]:.3f}; per round on/off "
              f"{min(a for a, _ in rounds):.3f}..{max(a for a, _ in rounds):.3f}, noise "
              f"{min(b for _, b in rounds):.3f}..{max(b for _, b in rounds):.3f}")
    print(f"shadow legs: started {shadow['started']}, compared {shadow['compared']}, dropped {shadow['dropped']}")
    print(f"load average at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
