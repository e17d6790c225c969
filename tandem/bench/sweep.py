"""A load ladder against one server: one benchmark run per concurrency (or request-rate) level,
written as a report folder (results.json, results.md, PNG plots)."""

from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import Any

from tandem.bench.client import BenchConfig, run_benchmark
from tandem.bench.datasets import SampleRequest
from tandem.bench.metrics import calculate_metrics
from tandem.bench.report import build_result, format_summary, markdown_table, plot_sweep, save_json

DEFAULT_CONCURRENCIES = (1, 2, 4, 8, 16, 32)
# NOTE: four waves per level keeps a level's run long enough to leave the ramp-up and ramp-down
# (first and last wave) a minority of the samples without making low levels take forever.
PROMPTS_PER_CONCURRENCY = 4
PROMPTS_PER_RATE_LEVEL = 100


def prompts_for_level(mode: str, level: float, num_prompts: int | None) -> int:
    """Requests to send at one level: `num_prompts` if given, else 4 x concurrency, or 100 for a
    request-rate level."""
    if num_prompts is not None:
        return num_prompts
    if mode == "concurrency":
        return max(1, PROMPTS_PER_CONCURRENCY * int(level))
    return PROMPTS_PER_RATE_LEVEL


def level_config(base: BenchConfig, mode: str, level: float) -> BenchConfig:
    """`base` with the level applied: concurrency levels send all at once (rate inf) behind a
    semaphore of `level`; rate levels keep base's max_concurrency."""
    if mode == "concurrency":
        return replace(base, max_concurrency=int(level), request_rate=math.inf)
    if mode == "rate":
        return replace(base, request_rate=float(level))
    raise ValueError(f"mode must be 'concurrency' or 'rate', got {mode!r}")


def run_sweep(
    base: BenchConfig,
    requests: list[SampleRequest],
    *,
    mode: str,
    levels: list[float],
    output_dir: str,
    percentiles: list[float],
    goodput_ms: dict[str, float] | None = None,
    tokenizer: Any | None = None,
    num_prompts: int | None = None,
    verbose: bool = True,
    workload: dict[str, Any] | None = None,
    environment: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run every level in order and write the report folder.

    `requests` is the pool each level takes its next N requests from (cycled if shorter), so levels
    do not resend each other's prompts when the pool is large enough;
    `workload` (prompt settings) is saved with each level's result, `environment`
    (`environment.collect_environment`) once at the top.
    Percentile 99 is always computed (the plots and table need it). Returns the results.json
    content: {"mode", "x_key", "levels", "runs": [saved result per level]}.
    Raises ValueError for an unknown mode or an empty ladder.
    """
    if not levels:
        raise ValueError("the sweep needs at least one level")
    if not requests:
        raise ValueError("no requests to send")
    pcts = sorted(set(percentiles) | {50.0, 99.0})
    x_key = "max_concurrency" if mode == "concurrency" else "request_rate"
    runs = []
    first = 0
    for level in levels:
        config = level_config(base, mode, level)
        n = prompts_for_level(mode, level, num_prompts)
        batch = [requests[(first + i) % len(requests)] for i in range(n)]
        first += n
        run = run_benchmark(config, batch)
        metrics = calculate_metrics(run.results, run.duration_s, pcts, goodput_ms, tokenizer)
        result = build_result(config, run, metrics, workload)
        runs.append(result)
        if verbose:
            print(f"\n{x_key} = {level}")
            print(format_summary(result, [p for p in pcts if p != 50.0]))
    report = {"mode": mode, "x_key": x_key, "levels": list(levels), "runs": runs, "environment": environment}
    write_report(report, output_dir)
    return report


def write_report(report: dict[str, Any], output_dir: str) -> list[str]:
    """Write results.json, results.md and the PNG plots of a sweep report; return the paths."""
    os.makedirs(output_dir, exist_ok=True)
    json_path = os.path.join(output_dir, "results.json")
    save_json(report, json_path)
    md_path = os.path.join(output_dir, "results.md")
    first = report["runs"][0]
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(f"# tandem bench sweep: {first['model_id']} at {first['base_url']}\n\n")
        f.write(
            f"endpoint {first['endpoint']}, burstiness {first['burstiness']}, "
            f"ignore_eos {first['ignore_eos']}; latencies in ms\n\n"
        )
        f.write(markdown_table(report["runs"], report["x_key"]))
    pngs = plot_sweep(report["runs"], report["x_key"], output_dir)
    return [json_path, md_path, *pngs]
