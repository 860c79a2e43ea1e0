"""A campaign's HTML report: the summary table and plots drawn from the raw rows (PNG files beside the HTML).

Plots: latency CDFs (TTFT, E2EL, time to headers), the ITL histogram, per-replica load, throughput and errors over
time, and, for the routing suite, the prefix-cache hit rate per policy. A rate sweep's report (`write_sweep_report`)
has a row per step, latency and throughput over the rates, and each step's own latency CDF and throughput plot.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from loadtests.metrics import Summary
from loadtests.sse_timing import StreamRow

BUCKET_S = 1.0
# A sweep step's own plots, shown again in the sweep's report.
STEP_PLOTS = ("latency_cdf.png", "throughput_errors.png")


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, seconds: Sequence[float], label: str) -> None:  # type: ignore[no-untyped-def]
    if seconds:
        ordered = sorted(s * 1000 for s in seconds)
        ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)


def latency_cdfs(rows: Sequence[StreamRow], out: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ok = [r for r in rows if r.ok]
    _cdf(ax, [r.ttft_s for r in ok if r.ttft_s is not None], "TTFT")
    _cdf(ax, [r.headers_s for r in ok if r.headers_s is not None], "time to headers")
    _cdf(ax, [r.e2el_s for r in ok if r.e2el_s is not None], "E2EL")
    ax.set_xscale("log")
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests")
    ax.legend()
    ax.grid(True, alpha=0.3)
    return _save(plt, fig, out / "latency_cdf.png")


def itl_histogram(rows: Sequence[StreamRow], out: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    gaps = [g * 1000 for r in rows if r.ok for g in r.gaps_s]
    ax.hist(gaps or [0.0], bins=60)
    ax.set_xlabel("inter-token latency (ms)")
    ax.set_ylabel("gaps")
    return _save(plt, fig, out / "itl_histogram.png")


def replica_load(summary: Summary, out: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    replicas = sorted(summary.per_replica)
    ax.bar(range(len(replicas)), [summary.per_replica[r] for r in replicas])
    ax.set_xticks(range(len(replicas)), [r[:12] for r in replicas], rotation=30)
    ax.set_ylabel("requests served")
    return _save(plt, fig, out / "replica_load.png")


def over_time(rows: Sequence[StreamRow], out: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    start = min((r.sent_at for r in rows), default=0.0)
    done: dict[int, int] = {}
    failed: dict[int, int] = {}
    for row in rows:
        bucket = int((row.sent_at + (row.e2el_s or 0.0) - start) // BUCKET_S)
        target = done if row.ok else failed
        target[bucket] = target.get(bucket, 0) + 1
    buckets = range(max([*done, *failed], default=0) + 1)
    ax.plot(list(buckets), [done.get(b, 0) / BUCKET_S for b in buckets], label="completed / s")
    ax.plot(list(buckets), [failed.get(b, 0) / BUCKET_S for b in buckets], label="errors / s")
    ax.set_xlabel("s since start")
    ax.legend()
    return _save(plt, fig, out / "throughput_errors.png")


def prefix_cache_rates(rates: dict[str, float], ideal: float, out: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    policies = sorted(rates)
    ax.bar(range(len(policies)), [rates[p] * 100 for p in policies])
    ax.axhline(ideal * 100, linestyle="--", label="ideal for the workload")
    ax.set_xticks(range(len(policies)), policies)
    ax.set_ylabel("prefix-cache hit rate (%)")
    ax.legend()
    return _save(plt, fig, out / "prefix_cache.png")


def _save(plt, fig, path: Path) -> Path:  # type: ignore[no-untyped-def]
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


class GateVerdict(BaseModel):
    """One gate of a campaign: what was measured against its limit, and whether the limit held."""

    name: str
    measured: float
    limit: float
    held: bool


def _table(cells: Sequence[Sequence[object]], header: Sequence[str] = ()) -> str:
    head = "".join(f"<th>{html.escape(name)}</th>" for name in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in cells)
    return f"<table>{'<tr>' + head + '</tr>' if head else ''}{body}</table>"


def write_report(
    title: str,
    summary: Summary,
    rows: Sequence[StreamRow],
    out: Path,
    extra_plots: Sequence[Path] = (),
    settings: Mapping[str, object] | None = None,
    gates: Sequence[GateVerdict] = (),
) -> Path:
    """`report.html` in `out`: the campaign's settings, the summary, each gate's verdict, then the plots."""
    plots = [latency_cdfs(rows, out), itl_histogram(rows, out), replica_load(summary, out), over_time(rows, out)]
    sections = []
    if settings is not None:
        sections.append("<h2>Settings</h2>" + _table(list(settings.items())))
    sections.append("<h2>Summary</h2>" + _table(list(summary.model_dump().items())))
    if gates:
        verdicts = [(g.name, f"{g.measured:.4g}", f"{g.limit:.4g}", "held" if g.held else "BREACHED") for g in gates]
        sections.append("<h2>Gates</h2>" + _table(verdicts, ("gate", "measured", "limit", "verdict")))
    images = "".join(
        f'<figure><img src="{p.name}" alt="{p.stem}"><figcaption>{p.stem}</figcaption></figure>'
        for p in [*plots, *extra_plots]
    )
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head><body>"
        f"<h1>{html.escape(title)}</h1>{''.join(sections)}{images}</body></html>"
    )
    path = out / "report.html"
    path.write_text(page)
    return path


def sweep_curves(steps: Sequence[Mapping[str, Any]], out: Path) -> Path:
    """TTFT (median, p99) and end-to-end p99 over the rates, and the throughput each rate reached."""
    plt = _pyplot()
    fig, latency = plt.subplots(figsize=(7, 4))
    rates = [step["rate"] for step in steps]
    for key, label in (("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99"), ("p99_e2el_ms", "E2EL p99")):
        latency.plot(rates, [step.get(key) or float("nan") for step in steps], marker="o", label=label)
    latency.set_xlabel("request rate (requests / s)")
    latency.set_ylabel("ms")
    latency.legend(loc="upper left")
    throughput = latency.twinx()
    throughput.plot(rates, [step.get("request_throughput") or 0.0 for step in steps], "k--", marker="s")
    throughput.set_ylabel("completed requests / s (dashed)")
    return _save(plt, fig, out / "sweep.png")


def write_sweep_report(title: str, steps: Sequence[Mapping[str, Any]], out: Path) -> Path:
    """`report.html` of a rate sweep in `out`: a row per step (linking its own report), the curves over the rates,
    then each step's latency CDF and throughput plot (its own files, under its folder)."""
    figures = [key for key in steps[0] if key not in ("rate", "folder", "breached")] if steps else []

    def cell(value: object) -> str:
        return f"{value:.4g}" if isinstance(value, float) else "-" if value is None else str(value)

    rows = [
        [f"{step['rate']:g}", *(cell(step.get(key)) for key in figures), "; ".join(step["breached"]) or "held"]
        for step in steps
    ]
    table = _table(rows, ("rate", *figures, "gates"))
    curves = sweep_curves(steps, out)
    figures_html = [f'<figure><img src="{curves.name}" alt="sweep"><figcaption>over the rates</figcaption></figure>']
    for step in steps:
        folder = html.escape(step["folder"])
        figures_html.append(f'<h2>rate {step["rate"]:g}: <a href="{folder}/report.html">its report</a></h2>')
        figures_html += [
            f'<figure><img src="{folder}/{plot}" alt="{plot}"><figcaption>{folder}: {plot}</figcaption></figure>'
            for plot in STEP_PLOTS
        ]
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head><body>"
        f"<h1>{html.escape(title)}</h1><h2>Steps</h2>{table}{''.join(figures_html)}</body></html>"
    )
    path = out / "report.html"
    path.write_text(page)
    return path
