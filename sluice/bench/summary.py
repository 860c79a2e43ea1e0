"""The paths bench's figures: medians of interleaved rounds with min and max, ratios to the replica port, the
terminal table and the chart."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

FIGURES = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "headers_p50_ms")
LIMIT_PATH = "replica_port"
# The limit a proxy can reach: a plain HAProxy in front of the same replica ports.
PROXY_LIMIT_PATH = "haproxy_only"
# Rounds per path and case: {path: {case label: [figures of one round, ...]}}.
Rounds = dict[str, dict[str, list[dict[str, float]]]]


def summarize(rounds: Rounds) -> dict[str, Any]:
    """Median, min and max of every figure per path and case, and the median's ratio to the replica port's and (where
    the run has it) to HAProxy alone's."""
    summary: dict[str, Any] = {}
    for path, by_case in rounds.items():
        summary[path] = {}
        for case, measured in by_case.items():
            entry = {}
            for figure in FIGURES:
                values = [m[figure] for m in measured]
                median = statistics.median(values)
                entry[figure] = {
                    "median": median,
                    "min": min(values),
                    "max": max(values),
                    "ratio": _ratio(median, rounds, LIMIT_PATH, case, figure),
                    "proxy_ratio": _ratio(median, rounds, PROXY_LIMIT_PATH, case, figure),
                }
            summary[path][case] = entry
    return summary


def _ratio(median: float, rounds: Rounds, path: str, case: str, figure: str) -> float | None:
    if path not in rounds:
        return None
    limit = statistics.median(m[figure] for m in rounds[path][case])
    return median / limit if limit else None


def proxy_table(summary: dict[str, Any], path: str = "direct") -> str:
    """`path` as a ratio to HAProxy alone, beside its ratio to the replica port, per case."""
    lines = [f"{'streams':>10}{'TTFT p50 ÷ haproxy_only':>26}{'÷ replica_port':>16}{'tok/s ÷ haproxy_only':>24}"]
    for case, entry in summary[path].items():
        ttft, tokens = entry["ttft_p50_ms"], entry["tokens_per_s"]
        lines.append(f"{case:>10}{ttft['proxy_ratio']:>26.2f}{ttft['ratio']:>16.2f}{tokens['proxy_ratio']:>24.2f}")
    return "\n".join(lines)


def table(summary: dict[str, Any]) -> str:
    lines = [f"{'path':<13}{'streams':>10}" + "".join(f"{f:>16}" for f in FIGURES)]
    for path, by_case in summary.items():
        for case, entry in by_case.items():
            cells = "".join(
                f"{entry[f]['median']:>9.1f} x{entry[f]['ratio']:<5.2f}"
                if entry[f]["ratio"] is not None
                else f"{'-':>16}"
                for f in FIGURES
            )
            lines.append(f"{path:<13}{case:>10}{cells}")
    return "\n".join(lines)


def chart(summary: dict[str, Any], path: Path, title: str) -> Path:
    """Tokens/s as a ratio to the replica port and TTFT p50, per case, a bar per path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(summary)
    cases = list(summary[LIMIT_PATH])
    for index, (name, by_case) in enumerate(summary.items()):
        xs = [i + index * width for i in range(len(cases))]
        axes[0].bar(xs, [by_case[c]["tokens_per_s"]["ratio"] for c in cases], width, label=name)
        axes[1].bar(xs, [by_case[c]["ttft_p50_ms"]["median"] for c in cases], width, label=name)
    for ax, figure in zip(axes, ("output tokens/s, ratio to the replica port", "TTFT p50 (ms)"), strict=True):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], [f"{c} streams" for c in cases])
        ax.set_title(figure)
    axes[0].legend(loc="lower left", fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
