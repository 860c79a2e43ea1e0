"""The paths bench's figures: medians of interleaved rounds with min and max, ratios to the replica port, `direct`
against HAProxy alone from paired rounds, the terminal tables and the chart."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from base.quantiles import median_interval

FIGURES = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "headers_p50_ms")
LIMIT_PATH = "replica_port"
# The limit a proxy can reach: a plain HAProxy in front of the same replica ports.
PROXY_LIMIT_PATH = "haproxy_only"
# Rounds per path and case: {path: {case label: [figures of one round, ...]}}.
Rounds = dict[str, dict[str, list[dict[str, float]]]]
# Back-to-back rounds of HAProxy alone and `direct` per case: {case label: [(HAProxy alone's, direct's), ...]}.
Pairs = dict[str, list[tuple[dict[str, float], dict[str, float]]]]
PAIRED_FIGURES = ("ttft_p50_ms", "tokens_per_s")


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


def paired_ratios(pairs: Pairs) -> dict[str, dict[str, dict[str, float]]]:
    """Per case and figure, `direct` ÷ HAProxy alone within each pair of back-to-back rounds (a drift of the machine
    between pairs cancels out): the median over the pairs, the 95 % interval that holds it (`low`, `high`), min and
    max."""
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for case, measured in pairs.items():
        ratios[case] = {}
        for figure in PAIRED_FIGURES:
            values = [direct[figure] / limit[figure] for limit, direct in measured if limit[figure]]
            low, high = median_interval(values)
            ratios[case][figure] = {
                "median": statistics.median(values),
                "low": low,
                "high": high,
                "min": min(values),
                "max": max(values),
                "pairs": len(values),
            }
    return ratios


def proxy_table(summary: dict[str, Any], paired: dict[str, dict[str, dict[str, float]]]) -> str:
    """`direct` as a ratio to HAProxy alone (median of the paired rounds' ratios, [its 95 % interval]), beside its
    ratio to the replica port, per paired case."""
    lines = [f"{'streams':>10}{'TTFT p50 ÷ haproxy_only':>30}{'÷ replica_port':>16}{'tok/s ÷ haproxy_only':>28}"]
    for case, ratios in paired.items():
        ttft, tokens = ratios["ttft_p50_ms"], ratios["tokens_per_s"]
        shown = [f"{r['median']:.2f} [{r['low']:.2f}-{r['high']:.2f}]" for r in (ttft, tokens)]
        to_port = summary["direct"][case]["ttft_p50_ms"]["ratio"]
        lines.append(f"{case:>10}{shown[0]:>30}{to_port:>16.2f}{shown[1]:>28}")
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
