"""Human and machine output of benchmark runs: console summary, JSON, Markdown table, PNG plots."""

from __future__ import annotations

import json
import math
import os
from datetime import datetime
from typing import Any

import numpy as np

from tandem.bench.client import BenchConfig, BenchRun
from tandem.bench.metrics import LATENCY_METRICS, percentile_key

_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def build_result(
    config: BenchConfig, run: BenchRun, metrics: dict[str, Any], workload: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The saved result of one run: run settings (with `workload`, the prompt settings of
    `datasets.workload_settings`), then `metrics` (vLLM's saved-result keys), then
    `peak_server_rss_bytes` and `spec_decode` (the run's speculative-decoding figures, see
    `spec_metrics.spec_decode_delta`; None when the server does not expose them). An infinite
    request rate is stored as the string "inf"."""
    rate = config.request_rate
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "tool": "tandem bench",
        "base_url": config.base_url,
        "endpoint": config.endpoint,
        "model_id": config.model,
        **(workload or {}),
        "num_prompts": len(run.results),
        "request_rate": "inf" if math.isinf(rate) else rate,
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "ignore_eos": config.ignore_eos,
        "seed": config.seed,
        **metrics,
        "server_pid": config.server_pid,
        "peak_server_rss_bytes": run.peak_rss_bytes,
        "spec_decode": run.spec_decode,
    }


def _ms(value: float | None) -> str:
    """A latency cell of the console summary: "n/a" when there was no sample (no success)."""
    return "n/a" if value is None else f"{value:.2f}"


def _spec_decode_lines(spec: dict[str, Any]) -> list[str]:
    """The speculative-decoding block of the console summary (vLLM's wording where it has one)."""
    rate, length = spec["acceptance_rate"], spec["mean_acceptance_length"]
    rows: list[tuple[str, Any]] = [
        ("Acceptance rate (%):", "n/a" if rate is None else f"{rate * 100:.2f}"),
        ("Acceptance length:", "n/a" if length is None else f"{length:.2f}"),
        ("Drafts:", spec["num_drafts"]),
        ("Draft tokens:", spec["num_draft_tokens"]),
        ("Accepted tokens:", spec["num_accepted_tokens"]),
    ]
    lines = ["{s:{c}^50}".format(s="Speculative Decoding", c="-")]
    lines += [f"{k:<40}{v:<10}" for k, v in rows]
    if spec["acceptance_rate_per_position"]:
        lines.append("Per-position acceptance (%):")
        lines += [f"{f'  Position {i}:':<40}{r * 100:<10.2f}"
                  for i, r in enumerate(spec["acceptance_rate_per_position"])]
    return lines


def format_summary(result: dict[str, Any], percentiles: list[float]) -> str:
    """Console summary in the layout of `vllm bench serve`, so the two read side by side; latencies
    without samples (e.g. every request failed) print as "n/a", not 0.00. A speculative-decoding
    block follows when the result has `spec_decode` figures."""
    rows: list[tuple[str, Any]] = [
        ("Successful requests:", result["completed"]),
        ("Failed requests:", result["failed"]),
    ]
    for kind, count in sorted(result.get("failures", {}).items()):
        rows.append((f"  {kind}:", count))
    rows += [
        ("Benchmark duration (s):", f"{result['duration']:.2f}"),
        ("Total input tokens:", result["total_input_tokens"]),
        ("Total generated tokens:", result["total_output_tokens"]),
        ("Request throughput (req/s):", f"{result['request_throughput']:.2f}"),
    ]
    if result.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s):", f"{result['request_goodput']:.2f}"))
    rows += [
        ("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}"),
        ("Total Token throughput (tok/s):", f"{result['total_token_throughput']:.2f}"),
    ]
    if result.get("peak_server_rss_bytes"):
        rows.append(("Peak server RSS (MiB):", f"{result['peak_server_rss_bytes'] / 2**20:.1f}"))
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{k:<40}{v:<10}" for k, v in rows]
    for name in LATENCY_METRICS:
        lines.append("{s:{c}^50}".format(s=_TITLES[name], c="-"))
        upper = name.upper()
        lines.append(f"{'Mean ' + upper + ' (ms):':<40}{_ms(result[f'mean_{name}_ms']):<10}")
        lines.append(f"{'Median ' + upper + ' (ms):':<40}{_ms(result[f'median_{name}_ms']):<10}")
        for p in percentiles:
            key = percentile_key(p)
            lines.append(f"{key.upper() + ' ' + upper + ' (ms):':<40}{_ms(result[f'{key}_{name}_ms']):<10}")
    if result.get("spec_decode") is not None:
        lines += _spec_decode_lines(result["spec_decode"])
    lines.append("=" * 50)
    return "\n".join(lines)


def save_json(data: Any, path: str) -> None:
    """Write `data` as indented JSON, creating parent folders."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def _cell(run: dict[str, Any], key: str, scale: float = 1.0) -> str:
    value = run.get(key)
    return "-" if value is None else f"{value * scale:.2f}"


def _spec_cells(run: dict[str, Any]) -> list[str]:
    """Acceptance rate (%), mean acceptance length, per-position acceptance (%, "/"-joined)."""
    spec = run.get("spec_decode")
    if spec is None:
        return ["-", "-", "-"]
    rate, length = spec["acceptance_rate"], spec["mean_acceptance_length"]
    per_pos = "/".join(f"{r * 100:.0f}" for r in spec["acceptance_rate_per_position"])
    return ["-" if rate is None else f"{rate * 100:.2f}", "-" if length is None else f"{length:.2f}",
            per_pos or "-"]


def markdown_table(runs: list[dict[str, Any]], x_key: str) -> str:
    """One row per run: load level, successes, failures, success rate, timeouts, OOMs, throughputs,
    p50/p99 latencies (ms), and, when any run has speculative-decoding figures, acceptance rate, mean acceptance length
    and per-position acceptance rates."""
    header = [
        x_key, "ok", "failed", "success %", "timeouts", "OOMs", "req/s", "goodput req/s", "out tok/s", "total tok/s",
        "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50", "ITL p99",
        "E2EL p50", "E2EL p99", "peak RSS MiB",
    ]
    with_spec = any(run.get("spec_decode") is not None for run in runs)
    if with_spec:
        header += ["accept %", "accept len", "accept % by pos"]
    keys = [
        "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
        "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
        "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in runs:
        cells = [str(run.get(x_key)), str(run["completed"]), str(run["failed"])]
        rate = run.get("success_rate")
        cells += ["n/a" if rate is None else f"{rate * 100:.1f}", str(run.get("timeouts", "n/a")),
                  str(run.get("ooms", "n/a"))]
        cells += [_cell(run, k) for k in keys]
        cells.append(_cell(run, "peak_server_rss_bytes", 1 / 2**20))
        if with_spec:
            cells += _spec_cells(run)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _figure(title: str, x_label: str, y_label: str, xs: list[float] | None) -> tuple[Any, Any]:
    """A figure on the Agg backend; with `xs`, ticks at the load levels (log2 axis if they span
    a factor of 4 or more)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator, ScalarFormatter

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    ax.set_title(title)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    if xs:
        if min(xs) > 0 and max(xs) / min(xs) >= 4:
            ax.set_xscale("log", base=2)
            ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(xs)
        ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig: Any, path: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def cdf_points(values: list[float]) -> tuple[list[float], list[float]]:
    """Step points of the empirical CDF of `values`, starting at (0, 0): plotted with
    `where="post"` the curve rises from 0 at each sample to 1 at the largest."""
    xs = sorted(values)
    return [0.0, *xs], [0.0, *(i / len(xs) for i in range(1, len(xs) + 1))]


def _nan(value: float | None) -> float:
    return np.nan if value is None else value


def plot_sweep(runs: list[dict[str, Any]], x_key: str, folder: str) -> list[str]:
    """Write throughput.png, ttft.png, tpot.png and latency_cdf.png into `folder`.

    x_key is the load-level field of each run (`max_concurrency` or `request_rate`).
    Returns the written paths.
    """
    xs = [run[x_key] for run in runs]
    label = "concurrency" if x_key == "max_concurrency" else "request rate (req/s)"
    paths = []
    fig, ax = _figure("Output token throughput", label, "tokens/s", xs)
    ax.plot(xs, [run["output_throughput"] for run in runs], marker="o")
    paths.append(_save(fig, os.path.join(folder, "throughput.png")))
    for name in ("ttft", "tpot"):
        fig, ax = _figure(_TITLES[name], label, "ms", xs)
        ax.plot(xs, [_nan(run[f"median_{name}_ms"]) for run in runs], marker="o", label="p50")
        ax.plot(xs, [_nan(run.get(f"p99_{name}_ms")) for run in runs], marker="s", label="p99")
        ax.legend()
        paths.append(_save(fig, os.path.join(folder, f"{name}.png")))
    fig, ax = _figure("Latency CDF (end-to-end, successful requests)", "E2EL (ms)", "fraction", None)
    for run in runs:
        ok = [e * 1000 for e, k in zip(run["e2els"], run["error_kinds"], strict=True) if k is None]
        if ok:
            ax.step(*cdf_points(ok), where="post", label=f"{x_key}={run[x_key]}")
    ax.set_xlim(left=0)
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize="small")
    paths.append(_save(fig, os.path.join(folder, "latency_cdf.png")))
    return paths
