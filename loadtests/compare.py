"""`sluice load compare A B`: two campaigns' `summary.json` side by side, B over A for each figure.

The figures are the vLLM keys every summary carries (`loadtests.vllm_result`): what was sent and completed, the
throughputs, and each latency's mean, median and p99. A figure one run lacks (an older summary, no SLO given) shows
as `-` and gets no ratio; a ratio over 0 is `-` too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loadtests.vllm_result import LATENCY_METRICS

SUMMARY_FILE = "summary.json"
COMPARED = (
    "completed",
    "failed",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_concurrent_requests",
    *(f"{stat}_{name}_ms" for name in LATENCY_METRICS for stat in ("mean", "median", "p99")),
)


class CompareError(ValueError):
    """A run that cannot be read: its folder or summary is missing or not a campaign's."""


def read_summary(run: Path) -> dict[str, Any]:
    """A campaign's summary, from its folder or the `summary.json` itself."""
    path = run / SUMMARY_FILE if run.is_dir() else run
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CompareError(f"{run}: no campaign summary ({error})") from None
    if isinstance(summary, dict) and "steps" in summary:
        folders = ", ".join(str(path.parent / step["folder"]) for step in summary["steps"])
        raise CompareError(f"{path}: a rate sweep's summary; compare two of its steps' folders: {folders}")
    if not isinstance(summary, dict) or "completed" not in summary:
        raise CompareError(f"{path}: not a `sluice load` summary (no `completed`)")
    return summary


def compared_rows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, float | None, float | None, float | None]]:
    """(figure, A, B, B / A) for every figure either run has."""
    rows = []
    for key in COMPARED:
        first, second = _number(a.get(key)), _number(b.get(key))
        if first is None and second is None:
            continue
        ratio = second / first if first and second is not None else None
        rows.append((key, first, second, ratio))
    return rows


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def comparison_lines(a_name: str, b_name: str, a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The table `sluice load compare` prints."""

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.4g}"

    width = max(len(key) for key in COMPARED)
    lines = [f"A: {a_name}", f"B: {b_name}", f"{'figure':<{width}} {'A':>12} {'B':>12} {'B/A':>8}"]
    for key, first, second, ratio in compared_rows(a, b):
        lines.append(f"{key:<{width}} {cell(first):>12} {cell(second):>12} {cell(ratio):>8}")
    return lines
