"""Routing policies side by side: 2 engines of 1 core behind ``tandem router`` vs 1 engine of 2 threads.

Usage:
    PYTHONPATH=$PWD python benchmarks/router_bench.py [--model PATH] [--system-tokens 1000]
        [--num-system-prompts 8] [--questions 4] [--question-tokens 16] [--output-len 16]
        [--concurrency 4,8,16] [--policies round-robin,least-load,kv-aware] [--kv-events]
        [--workloads shared,random] [--single-on shared,random]
        [--long-prefill-token-threshold 256] [--max-long-partial-prefills 1] [--scheduling-policy lpm]
        [--kv-cache-gib 1.0] [--single-kv-cache-gib 2.0] [--work-dir DIR] [--json FILE]

Starts three ``tandem serve`` processes of ``--model`` (default: the default model): engines A and B
with one thread each, pinned to cores 0 and 1, and engine S with two threads on cores 0-1; and one
``tandem router`` per policy over A and B. All three engines get the same scheduler settings, by default
``tandem serve``'s CPU defaults (``CPU_SERVE_SCHEDULING``): prefill chunks of at most
``--long-prefill-token-threshold`` tokens (256), ``--max-long-partial-prefills`` long prompts at once (1),
so a prefix hit samples within a step or two instead of waiting behind every 1,000-token prompt's chunks,
and ``--scheduling-policy`` lpm (longest prefix-cache hit first); ``0 0 fcfs`` gives vLLM's (one step
then takes up to 2,048 tokens, about 30 s on one core of this model). S is measured directly (no router).
Everything is stopped at the end (process groups, SIGTERM then SIGKILL). A and B get ``--kv-cache-gib``
each and S the pair's total (``--single-kv-cache-gib``, default twice that): with a cache that holds only
some of the system prompts per engine (the default model's KV is about 23 KB per token: 0.12 GiB holds
about 5 of 8 1,000-token prompts), round-robin makes each engine cycle through all of them and evict,
where kv-aware keeps each prompt on one engine.

Workloads (each run draws fresh random prompts, so no run finds another's blocks in a cache):
- ``shared``: ``--num-system-prompts`` random system prompts of exactly ``--system-tokens`` tokens,
  each followed by ``--questions`` different random questions of ``--question-tokens`` tokens,
  shuffled: requests with the same system prompt can reuse its KV blocks.
- ``random``: the control, the same number of prompts of the same length with no shared prefix.

For each workload, concurrency and target (S, or the router with a policy) the client of
``tandem bench`` (``tandem/bench/client.py``) sends every request at once under the concurrency
cap, greedy, ``max_tokens`` = ``--output-len`` with ``ignore_eos``. Reported per run: the prefix
cache hit rate (``tandem:prefix_cache_hits_total`` / ``queries_total`` increase over the run's
engines: prompt tokens served from cache), TTFT p50 / p99 (ms), output tokens/s. Then the issue's
goals, as ratios from this one run: kv-aware's hit rate vs S's (>= 0.9), round-robin's TTFT p50 over
kv-aware's on ``shared`` (>= 2), kv-aware's TTFT p50 over least-load's on ``random`` (<= 1.05).
The load average is printed at the start and the end (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tandem.bench.client import BenchConfig, run_benchmark
from tandem.bench.datasets import SampleRequest, load_tokenizer, random_requests
from tandem.bench.metrics import calculate_metrics
from tandem.config import CPU_SERVE_SCHEDULING

REPO = Path(__file__).resolve().parents[1]
SERVED = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A subprocess in its own process group with its output in ``log``; ``url`` once it listens."""

    def __init__(self, name: str, cmd: list[str], port: int, work: Path) -> None:
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log_path = work / f"{name}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not healthy after {timeout_s} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def serve(name: str, args: argparse.Namespace, work: Path, threads: int, cores: str, kv_gib: float) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "--log-level", "INFO", "serve", "--served-model-name", SERVED,
           "--port", str(port), "--num-threads", str(threads), "--cpu-bind", cores,
           "--kv-cache-gib", str(kv_gib), "--max-queue-len", "4096",
           "--long-prefill-token-threshold", str(args.long_prefill_token_threshold),
           "--max-long-partial-prefills", str(args.max_long_partial_prefills),
           "--scheduling-policy", args.scheduling_policy]
    if args.model:
        cmd += ["--model", args.model]
    if args.kv_events and threads == 1:
        cmd += ["--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*", '
                '"replay_endpoint": "tcp://127.0.0.1:*"}']
    return Proc(name, cmd, port, work)


def router(policy: str, backends: list[Proc], work: Path) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "--log-level", "WARNING", "router", "--port", str(port),
           "--policy", policy, *[a for b in backends for a in ("--backend", b.url)]]
    return Proc(f"router-{policy}", cmd, port, work)


def workload(kind: str, tokenizer, args: argparse.Namespace, seed: int) -> list[SampleRequest]:
    """The requests of one run (fresh random text from ``seed``)."""
    n = args.num_system_prompts * args.questions
    if kind == "random":
        total = args.system_tokens + args.question_tokens
        return random_requests(tokenizer, n, total, args.output_len, 0.0, seed)
    systems = random_requests(tokenizer, args.num_system_prompts, args.system_tokens, 1, 0.0, seed)
    questions = random_requests(tokenizer, n, args.question_tokens, 1, 0.0, seed + 1)
    reqs = [SampleRequest(s.prompt + q.prompt, None, args.output_len)
            for i, s in enumerate(systems) for q in questions[i * args.questions:(i + 1) * args.questions]]
    random.Random(seed).shuffle(reqs)
    return reqs


def cache_counters(engines: list[Proc]) -> tuple[float, float]:
    """Summed (hits, queries) prefix-cache token counters of ``engines``."""
    from prometheus_client.parser import text_string_to_metric_families

    hits = queries = 0.0
    for e in engines:
        for family in text_string_to_metric_families(httpx.get(f"{e.url}/metrics", timeout=10).text):
            for s in family.samples:
                if s.name == "tandem:prefix_cache_hits_total":
                    hits += s.value
                elif s.name == "tandem:prefix_cache_queries_total":
                    queries += s.value
    return hits, queries


def measure(target: Proc, engines: list[Proc], reqs: list[SampleRequest], concurrency: int) -> dict:
    before = cache_counters(engines)
    config = BenchConfig(base_url=target.url, model=SERVED, max_concurrency=concurrency, ignore_eos=True,
                         disable_tqdm=True, timeout=1800.0)
    run = run_benchmark(config, reqs)
    time.sleep(1.5)  # NOTE: the servers' prefix-cache counters follow the engine's stats snapshots
    after = cache_counters(engines)
    m = calculate_metrics(run.results, run.duration_s, [50.0, 99.0])
    queries = after[1] - before[1]
    return {"hit_rate": (after[0] - before[0]) / queries if queries else 0.0, "failed": m["failed"],
            "ttft_p50_ms": m["median_ttft_ms"], "ttft_p99_ms": m["p99_ttft_ms"],
            "output_tok_s": m["output_throughput"], "duration_s": run.duration_s}


def report(rows: list[dict], policies: list[str]) -> None:
    print(f"\n{'workload':8} {'conc':>4} {'target':12} {'hit':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'tok/s':>7} fail")
    for r in rows:
        print(f"{r['workload']:8} {r['concurrency']:>4} {r['target']:12} {r['hit_rate']:6.3f} {r['ttft_p50_ms']:9.0f} "
              f"{r['ttft_p99_ms']:9.0f} {r['output_tok_s']:7.1f} {r['failed']}")
    cell = {(r["workload"], r["concurrency"], r["target"]): r for r in rows}
    print("\ngoals (ratios within this run):")
    for c in sorted({r["concurrency"] for r in rows}):
        kv = cell.get(("shared", c, "kv-aware"))
        parts = [f"conc {c}:"]
        if kv is not None and ("shared", c, "single") in cell:
            hit = kv["hit_rate"] / max(cell[("shared", c, "single")]["hit_rate"], 1e-9)
            parts.append(f"kv-aware hit / single-engine hit = {hit:.2f} (goal >= 0.9)")
        if kv is not None and ("shared", c, "round-robin") in cell:
            speedup = cell[("shared", c, "round-robin")]["ttft_p50_ms"] / kv["ttft_p50_ms"]
            parts.append(f"rr / kv TTFT p50 shared = {speedup:.2f} (goal >= 2)")
        if ("random", c, "least-load") in cell and ("random", c, "kv-aware") in cell:
            ratio = cell[("random", c, "kv-aware")]["ttft_p50_ms"] / cell[("random", c, "least-load")]["ttft_p50_ms"]
            parts.append(f"kv / ll TTFT p50 random = {ratio:.2f} (goal <= 1.05)")
        print("  " + parts[0] + " " + "; ".join(parts[1:]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder or .gguf (default: the default model)")
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--num-system-prompts", type=int, default=8)
    p.add_argument("--questions", type=int, default=4, help="questions per system prompt")
    p.add_argument("--question-tokens", type=int, default=16)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", default="4,8,16")
    p.add_argument("--policies", default="round-robin,least-load,kv-aware")
    p.add_argument("--workloads", default="shared,random")
    p.add_argument("--single-on", default=None,
                   help="the workloads engine S runs too (default: all; the goals use S on shared only)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache of each of engines A and B (GiB)")
    p.add_argument("--single-kv-cache-gib", type=float, default=None,
                   help="engine S's KV cache (GiB; default: twice --kv-cache-gib, the pair's total)")
    cpu = CPU_SERVE_SCHEDULING
    p.add_argument("--long-prefill-token-threshold", type=int, default=cpu.long_prefill_token_threshold,
                   help="every engine's prefill chunk cap (tokens; 0 = the step budget)")
    p.add_argument("--max-long-partial-prefills", type=int, default=cpu.max_long_partial_prefills,
                   help="every engine's limit on prompts with more than the threshold left computing at once "
                        "(0 = none): prefix hits then overtake long prompts")
    p.add_argument("--scheduling-policy", default=cpu.policy, choices=["fcfs", "lpm"],
                   help="every engine's admission order (lpm: longest prefix-cache hit first)")
    p.add_argument("--kv-events", action="store_true",
                   help="engines A and B publish KV events (kv-aware then routes on them; default: the "
                        "router's approximate prefix index)")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args()
    policies = args.policies.split(",")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="router-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"load average at start: {os.getloadavg()}; logs in {work}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # NOTE: `kill` of the bench stops its servers too
    single_gib = args.single_kv_cache_gib if args.single_kv_cache_gib is not None else 2 * args.kv_cache_gib
    a = serve("engine-a", args, work, 1, "0", args.kv_cache_gib)
    b = serve("engine-b", args, work, 1, "1", args.kv_cache_gib)
    single = serve("engine-single", args, work, 2, "0-1", single_gib)
    procs = [a, b, single]
    try:
        for e in procs:
            e.wait_healthy(900)
        routers = {pol: router(pol, [a, b], work) for pol in policies}
        procs += routers.values()
        for r in routers.values():
            r.wait_healthy(600)
        root = httpx.get(f"{a.url}/v1/models", timeout=10).json()["data"][0]["root"]
        tokenizer = load_tokenizer(root)
        rows, seed = [], 1000
        for kind in args.workloads.split(","):
            for c in [int(x) for x in args.concurrency.split(",")]:
                single_on = (args.single_on or args.workloads).split(",")
                for name in (["single"] if kind in single_on else []) + policies:
                    seed += 10
                    reqs = workload(kind, tokenizer, args, seed)
                    target, engines = (single, [single]) if name == "single" else (routers[name], [a, b])
                    row = {"workload": kind, "concurrency": c, "target": name,
                           **measure(target, engines, reqs, c)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
        report(rows, policies)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    finally:
        for proc in reversed(procs):
            proc.stop()
        print(f"load average at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
