"""Side-by-side comparison of two saved benchmark results, with a regression gate for CI.

Works on `tandem bench serve --save-result` files, on `tandem bench sweep` results.json (levels
are matched by their load level), and on `vllm bench serve --save-result` files, which use the
same key names. Failures are compared too (`failed`, `success_rate`), and a latency stored as null
(no successful request) on the new side is a regression, so a run in which everything failed never
passes the gate.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

from tandem.bench.environment import environment_differences

DEFAULT_METRICS = (
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
    "failed",
    "success_rate",
)
_HIGHER_IS_BETTER = ("throughput", "goodput", "completed", "success_rate")
_LOWER_IS_BETTER_SUFFIXES = ("_ms", "failed", "_bytes", "duration")
# Settings that define the load; two runs that differ in one compare different workloads.
WORKLOAD_KEYS = ("endpoint", "dataset", "dataset_path", "input_len", "output_len", "range_ratio", "num_prompts",
                 "ignore_eos")


def parse_threshold(text: str) -> float:
    """`5%` or `5` -> 0.05 (a fraction). Raises ValueError for a negative or non-numeric value."""
    value = float(text.strip().removesuffix("%"))
    if value < 0:
        raise ValueError(f"max regression must be >= 0, got {text!r}")
    return value / 100.0


def higher_is_better(metric: str) -> bool:
    """Direction of a metric from its name: throughputs/goodput/completed/success rate up,
    latencies (`_ms`), failures, bytes and duration down. Raises ValueError for a name it cannot
    classify."""
    if any(word in metric for word in _HIGHER_IS_BETTER):
        return True
    if metric.endswith(_LOWER_IS_BETTER_SUFFIXES):
        return False
    raise ValueError(f"cannot tell whether higher or lower {metric!r} is better")


@dataclass(frozen=True)
class Row:
    """One metric of one load level in both runs; None = no value (e.g. a latency of a run in
    which every request failed). ratio = new / base (None when either is None or base is 0)."""

    label: str
    metric: str
    base: float | None
    new: float | None
    ratio: float | None
    regressed: bool


def is_regression(base: float, new: float, higher_better: bool, threshold: float) -> bool:
    """True when `new` is worse than `base` by more than `threshold` (a fraction of base).

    With base 0 any worsening counts, since no relative change can be formed.
    """
    if higher_better:
        return new < base * (1.0 - threshold) if base else new < base
    return new > base * (1.0 + threshold) if base else new > base


def load_runs(path: str) -> dict[str, dict[str, Any]]:
    """{label: result}: one entry `run` for a single result, `<x_key>=<level>` per sweep level.

    Raises ValueError for a file that is neither.
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if isinstance(data, dict) and isinstance(data.get("runs"), list):
        x_key = data.get("x_key", "max_concurrency")
        return {f"{x_key}={run.get(x_key)}": run for run in data["runs"]}
    if isinstance(data, dict) and "completed" in data:
        return {"run": data}
    raise ValueError(f"{path}: not a benchmark result or sweep results.json")


def load_environment(path: str) -> dict[str, Any] | None:
    """The `environment` recorded in a result or sweep file (None for results without one)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data.get("environment") if isinstance(data, dict) else None


def metric_value(run: dict[str, Any], metric: str, label: str) -> float | None:
    """`run[metric]` as a float, or None when stored as null (no sample).

    `failed` and `success_rate` are derived from `completed` and `num_prompts` (or `failed`) when a
    result (e.g. an older or vLLM one) lacks them. Raises ValueError when the metric is absent or
    not a number.
    """
    if metric in ("failed", "success_rate") and metric not in run:
        completed, failed, sent = run.get("completed"), run.get("failed"), run.get("num_prompts")
        if isinstance(completed, int) and not isinstance(sent, int) and isinstance(failed, int):
            sent = completed + failed
        if isinstance(completed, int) and isinstance(sent, int):
            if metric == "failed":
                return float(sent - completed)
            return completed / sent if sent else None
    if metric not in run:
        raise ValueError(f"{label}: metric {metric!r} missing")
    value = run[metric]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{label}: metric {metric!r} is not a number: {value!r}")
    return float(value)


def compare_runs(
    base: dict[str, dict[str, Any]],
    new: dict[str, dict[str, Any]],
    metrics: list[str],
    threshold: float,
) -> list[Row]:
    """Rows for every (level, metric) pair.

    A null on the new side is a regression (the new run measured nothing, e.g. every request
    failed); a null only on the base side is not. Raises ValueError when the levels differ, a
    metric is missing from either side, or it is null in both while the new run had successes
    (a metric that was never measured, such as request_goodput without --goodput).
    """
    if set(base) != set(new):
        raise ValueError(f"load levels differ: {sorted(base)} vs {sorted(new)}")
    rows = []
    for label in base:
        for metric in metrics:
            higher = higher_is_better(metric)
            b, n = metric_value(base[label], metric, label), metric_value(new[label], metric, label)
            if b is None and n is None and new[label].get("completed"):
                raise ValueError(f"{label}: metric {metric!r} is null in both runs (not measured)")
            regressed = n is None or (b is not None and is_regression(b, n, higher, threshold))
            ratio = n / b if b and n is not None else None
            rows.append(Row(label, metric, b, n, ratio, regressed))
    return rows


def workload_differences(base: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]]) -> list[str]:
    """`key: base vs new` for each workload setting (WORKLOAD_KEYS) recorded in both runs of a
    level with different values, each listed once."""
    found: dict[str, None] = {}
    for label in base:
        for key in WORKLOAD_KEYS:
            if label in new and key in base[label] and key in new[label]:
                b, n = base[label][key], new[label][key]
                if b != n:
                    found[f"{key}: {b!r} vs {n!r}"] = None
    return list(found)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def format_table(rows: list[Row], threshold: float) -> str:
    """Markdown table of the rows with a verdict column; missing values print as n/a."""
    lines = [
        f"| level | metric | base | new | new/base | verdict (max regression {threshold:.1%}) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.3f}"
        verdict = "REGRESSION" if r.regressed else "ok"
        lines.append(f"| {r.label} | {r.metric} | {_fmt(r.base)} | {_fmt(r.new)} | {ratio} | {verdict} |")
    return "\n".join(lines)


def run_compare(base_path: str, new_path: str, metrics: list[str], threshold: float) -> int:
    """Print the table and return the exit code: 1 if any metric regressed, else 0. Warns on
    stderr when the two runs' workloads differ (the comparison still runs).

    Also warns when their recorded environments differ (`environment.environment_differences`).
    Raises ValueError/OSError for unreadable or mismatched inputs (the CLI turns them into 2).
    """
    base, new = load_runs(base_path), load_runs(new_path)
    rows = compare_runs(base, new, metrics, threshold)
    differences = workload_differences(base, new)
    if differences:
        print("tandem bench compare: warning: the runs used different workloads, so their numbers are not "
              "comparable: " + "; ".join(differences), file=sys.stderr)
    env_differences = environment_differences(load_environment(base_path), load_environment(new_path))
    if env_differences:
        print("tandem bench compare: warning: the runs were measured in different environments:\n  "
              + "\n  ".join(env_differences), file=sys.stderr)
    print(format_table(rows, threshold))
    bad = [r for r in rows if r.regressed]
    if bad:
        print(f"\n{len(bad)} metric(s) regressed by more than {threshold:.1%}:")
        for r in bad:
            print(f"  {r.label} {r.metric}: {_fmt(r.base)} -> {_fmt(r.new)}")
        return 1
    print(f"\nno metric regressed by more than {threshold:.1%}")
    return 0
