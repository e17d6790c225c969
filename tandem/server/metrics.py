"""Prometheus metrics named like vLLM's (``vllm:`` -> ``tandem:``) so dashboards port by a rename.

Gauges follow the latest engine-core stats snapshot; cumulative engine counters (prefix cache,
preemptions) are turned into Prometheus counters by their increments. Per-request timings are
measured in the front end (``time.monotonic``) from the request's arrival in ``AsyncLLM``: TTFT to
its first token, ITL between token arrivals, e2e to its finish. Requests are engine requests: a
prompt with ``n = 2`` counts twice, as in vLLM. Each server owns its own ``CollectorRegistry``.
"""

from __future__ import annotations

from collections.abc import Callable

import psutil
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics_core import Metric

from tandem.engine.core_proc import CoreStats

# Bucket edges from vLLM's v1 metrics (vllm/v1/metrics/loggers.py), in seconds / tokens.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


# The KV connector's cumulative counters (tandem/disagg/connector.py), exported as tandem:kv_transfer_<name>.
KV_TRANSFER_COUNTERS = {
    "pulls": "Decode side: requests whose prompt KV was pulled from a prefill engine.",
    "pull_failures": "Decode side: KV pulls that failed (unreachable, refused, expired lease, reused blocks).",
    "local_prefills": "Decode side: requests prefilled here instead (prefill_failure_policy local).",
    "prefix_hits": "Decode side: requests whose whole remote prefix was already in the local prefix cache.",
    "bytes_received": "Decode side: KV bytes received.",
    "pull_seconds": "Decode side: seconds spent in KV pulls.",
    "pulls_served": "Prefill side: KV pulls served.",
    "bytes_sent": "Prefill side: KV bytes sent.",
    "peers_refused": "Prefill side: KV transfer peers refused (identity, secret, protocol).",
    "pull_errors_served": "Prefill side: pulls refused (unknown or expired lease, reused blocks).",
    "remote_hosts_refused": "Decode side: decode legs refused (400) for naming a producer outside prefill_hosts.",
}


class ServerMetrics:
    """All Prometheus series of one server, labelled with ``model_name`` and ``instance_id``.

    Args:
        model_name: the served model name (the ``model_name`` label, as in vLLM).
        core_pid: a callable giving the engine-core pid (for its resident memory; None once it is
            gone), or None.
        instance_id: this server's id (the ``instance_id`` label; routers tell engines apart by it).
        kernel_backend: the engine core's kernel path (``tandem/kernels/registry.py``), exported as the
            info-style gauge ``tandem:kernel_backend_info{model_name, instance_id, backend} 1``; None: none.
    """

    def __init__(self, model_name: str, core_pid: Callable[[], int | None] | None = None,
                 instance_id: str = "", kernel_backend: str | None = None, process: bool = True) -> None:
        self.registry = CollectorRegistry()
        self.core_pid = core_pid
        reg, labels, values = self.registry, ["model_name", "instance_id"], (model_name, instance_id)
        if process:
            ProcessCollector(registry=reg)  # process_resident_memory_bytes etc. of the front end

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"tandem:{name}", doc, labels, registry=reg).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"tandem:{name}", doc, labels, registry=reg).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(f"tandem:{name}", doc, labels, buckets=buckets, registry=reg).labels(*values)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV cache usage: 1 means 100 percent.")
        self.core_memory = gauge("engine_core_resident_memory_bytes", "Resident memory of the engine core.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens served by the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.spec_num_drafts = counter("spec_decode_num_drafts", "Speculative verifications (one per request step).")
        self.spec_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.core_restarts = counter("engine_core_restarts", "Engine-core processes restarted after a death.")
        self.kv_transfer = {name: counter(f"kv_transfer_{name}", doc) for name, doc in KV_TRANSFER_COUNTERS.items()}
        self._spec_per_pos = Counter("tandem:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by draft position (0-based).",
                                     [*labels, "position"], registry=reg)
        self._success = Counter("tandem:request_success", "Finished requests by finish reason.",
                                [*labels, "finished_reason"], registry=reg)
        self.labels = values
        for reason in ("stop", "length", "abort"):
            self._success.labels(*values, reason)  # NOTE: export zeros before the first finish
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduling.",
                                    REQUEST_LATENCY_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step.",
                                          ITERATION_TOKEN_BUCKETS)
        self._last = CoreStats()
        if kernel_backend is not None:
            Gauge("tandem:kernel_backend_info", "Kernel path of the engine core (the backend label); always 1.",
                  [*labels, "backend"], registry=reg).labels(*values, kernel_backend).set(1)

    def record_step(self, stats: CoreStats, num_batched_tokens: int) -> None:
        """Gauges from the snapshot; counters by the increase of the core's cumulative counters."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        last = self._last
        self.prefix_cache_queries.inc(max(0, stats.prefix_cache_queries - last.prefix_cache_queries))
        self.prefix_cache_hits.inc(max(0, stats.prefix_cache_hits - last.prefix_cache_hits))
        self.num_preemptions.inc(max(0, stats.num_preemptions - last.num_preemptions))
        self.spec_num_drafts.inc(max(0, stats.spec_num_drafts - last.spec_num_drafts))
        self.spec_num_draft_tokens.inc(max(0, stats.spec_num_draft_tokens - last.spec_num_draft_tokens))
        self.spec_num_accepted_tokens.inc(max(0, stats.spec_num_accepted_tokens - last.spec_num_accepted_tokens))
        previous = last.spec_num_accepted_tokens_per_pos
        for pos, count in enumerate(stats.spec_num_accepted_tokens_per_pos):
            before = previous[pos] if pos < len(previous) else 0
            self._spec_per_pos.labels(*self.labels, str(pos)).inc(max(0, count - before))
        for name, series in self.kv_transfer.items():
            series.inc(max(0.0, stats.kv_transfer.get(name, 0.0) - last.kv_transfer.get(name, 0.0)))
        self._last = stats
        if num_batched_tokens > 0:
            self.iteration_tokens.observe(num_batched_tokens)

    def record_queue_time(self, seconds: float) -> None:
        self.queue_time.observe(seconds)

    def record_first_token(self, ttft: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft)
        self.prompt_tokens.inc(num_prompt_tokens)

    def record_tokens(self, num_tokens: int, itl: float | None) -> None:
        self.generation_tokens.inc(num_tokens)
        if itl is not None:
            self.itl.observe(itl)

    def record_finished(self, finish_reason: str, e2e: float) -> None:
        self._success.labels(*self.labels, finish_reason).inc()
        self.e2e.observe(e2e)

    def record_core_restart(self) -> None:
        self.core_restarts.inc()

    def clear_gauges(self) -> None:
        """Zeroes the core's gauges: it is gone, so nothing runs, waits or holds KV blocks."""
        for gauge in (self.num_requests_running, self.num_requests_waiting, self.kv_cache_usage):
            gauge.set(0)

    def render(self) -> bytes:
        """The Prometheus text exposition of every series (refreshes the core's memory first)."""
        self.refresh()
        return generate_latest(self.registry)

    def refresh(self) -> None:
        """Reads the engine core's resident memory into its gauge (0 without a live core)."""
        pid = self.core_pid() if self.core_pid is not None else None
        rss = 0  # NOTE: no core (or a dead one): nothing resident
        if pid is not None:
            try:
                rss = psutil.Process(pid).memory_info().rss
            except psutil.Error:
                pass
        self.core_memory.set(rss)


class DataParallelMetrics:
    """The series of N engine cores in one exposition: each engine's ``ServerMetrics`` (``engines``)
    gets the extra label ``engine`` (its rank); the front end's process series appear once, and so
    does the edge's own ``tandem:request_redispatches_total{engine}`` (``engine/dp_llm.py``).

    Args:
        parts: one ``ServerMetrics`` per engine (made with ``process=False``), in rank order.
    """

    def __init__(self, parts: list[ServerMetrics]) -> None:
        self.engines = parts
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.registry.register(_EngineLabelled(parts))
        self._redispatches = Counter(
            "tandem:request_redispatches", "Prompts re-sent to another engine because their engine core died "
            "before any output reached the client, by the engine they left.",
            ["model_name", "instance_id", "engine"], registry=self.registry)
        self.labels = parts[0].labels if parts else ("", "")
        for rank in range(len(parts)):
            self._redispatches.labels(*self.labels, str(rank))  # NOTE: export zeros before the first one

    def record_redispatch(self, rank: int) -> None:
        """Counts one prompt moved away from engine ``rank`` (``tandem:request_redispatches_total``)."""
        self._redispatches.labels(*self.labels, str(rank)).inc()

    def render(self) -> bytes:
        for part in self.engines:
            part.refresh()
        return generate_latest(self.registry)


class _EngineLabelled:
    """A prometheus_client collector: every family of the parts' registries, samples labelled by rank."""

    def __init__(self, parts: list[ServerMetrics]) -> None:
        self.parts = parts

    def collect(self):
        merged: dict[str, Metric] = {}
        for rank, part in enumerate(self.parts):
            for family in part.registry.collect():
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                out.samples.extend(s._replace(labels={**s.labels, "engine": str(rank)}) for s in family.samples)
        return list(merged.values())
