"""Side-by-side comparison of two saved benchmark results, with a regression gate for CI.

Works on `tandem bench serve --save-result` files, on `tandem bench sweep` results.json (levels
are matched by their load level), and on `vllm bench serve --save-result` files, which use the
same key names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

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
)
_HIGHER_IS_BETTER = ("throughput", "goodput", "completed")
_LOWER_IS_BETTER_SUFFIXES = ("_ms", "failed", "_bytes", "duration")


def parse_threshold(text: str) -> float:
    """`5%` or `5` -> 0.05 (a fraction). Raises ValueError for a negative or non-numeric value."""
    value = float(text.strip().removesuffix("%"))
    if value < 0:
        raise ValueError(f"max regression must be >= 0, got {text!r}")
    return value / 100.0


def higher_is_better(metric: str) -> bool:
    """Direction of a metric from its name: throughputs/goodput/completed up, latencies (`_ms`),
    failures, bytes and duration down. Raises ValueError for a name it cannot classify."""
    if any(word in metric for word in _HIGHER_IS_BETTER):
        return True
    if metric.endswith(_LOWER_IS_BETTER_SUFFIXES):
        return False
    raise ValueError(f"cannot tell whether higher or lower {metric!r} is better")


@dataclass(frozen=True)
class Row:
    """One metric of one load level in both runs. ratio = new / base (None when base is 0)."""

    label: str
    metric: str
    base: float
    new: float
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


def compare_runs(
    base: dict[str, dict[str, Any]],
    new: dict[str, dict[str, Any]],
    metrics: list[str],
    threshold: float,
) -> list[Row]:
    """Rows for every (level, metric) pair. Raises ValueError when the levels differ or a metric
    is missing (absent or null) from either side."""
    if set(base) != set(new):
        raise ValueError(f"load levels differ: {sorted(base)} vs {sorted(new)}")
    rows = []
    for label in base:
        for metric in metrics:
            b, n = base[label].get(metric), new[label].get(metric)
            if not isinstance(b, int | float) or not isinstance(n, int | float):
                raise ValueError(f"{label}: metric {metric!r} missing (base {b!r}, new {n!r})")
            higher = higher_is_better(metric)
            ratio = n / b if b else None
            rows.append(Row(label, metric, float(b), float(n), ratio, is_regression(b, n, higher, threshold)))
    return rows


def format_table(rows: list[Row], threshold: float) -> str:
    """Markdown table of the rows with a verdict column."""
    lines = [
        f"| level | metric | base | new | new/base | verdict (max regression {threshold:.1%}) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.3f}"
        verdict = "REGRESSION" if r.regressed else "ok"
        lines.append(f"| {r.label} | {r.metric} | {r.base:.2f} | {r.new:.2f} | {ratio} | {verdict} |")
    return "\n".join(lines)


def run_compare(base_path: str, new_path: str, metrics: list[str], threshold: float) -> int:
    """Print the table and return the exit code: 1 if any metric regressed, else 0.

    Raises ValueError/OSError for unreadable or mismatched inputs (the CLI turns them into 2).
    """
    rows = compare_runs(load_runs(base_path), load_runs(new_path), metrics, threshold)
    print(format_table(rows, threshold))
    bad = [r for r in rows if r.regressed]
    if bad:
        print(f"\n{len(bad)} metric(s) regressed by more than {threshold:.1%}:")
        for r in bad:
            print(f"  {r.label} {r.metric}: {r.base:.2f} -> {r.new:.2f}")
        return 1
    print(f"\nno metric regressed by more than {threshold:.1%}")
    return 0
