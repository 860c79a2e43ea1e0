"""`sluice load WORKLOAD --rate 2,4,8`: a rate sweep, one campaign per rate, then one report over them all.

Each step is a whole campaign at its rate (an open loop for any workload) in a folder of its own, `rate-<R>`
(its rows, `summary.json`, `report.html` and gates, as a single campaign writes them), run one after another on the
same target. The sweep's folder then holds `summary.json` (the rates, and per step its folder and vLLM's figures) and
`report.html`: a row per step, a chart of latency and throughput over the rates, and each step's own charts. A gate
holds per step: a breach names its step's rate.
"""

from __future__ import annotations

import json
import math
from typing import Any

from loadtests.campaign import Campaign, run
from loadtests.report import write_sweep_report

SUMMARY_FILE = "summary.json"
# The figures a step's row shows, from its `summary.json` (vLLM's keys, `loadtests.vllm_result`).
STEP_FIGURES = (
    "completed",
    "failed",
    "request_throughput",
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_e2el_ms",
    "request_goodput",
)


def parse_rates(text: str) -> list[float]:
    """`--rate`'s value: one rate, or several joined by commas (a sweep), each a positive number of requests per
    second; ValueError says which is wrong."""
    rates = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"--rate {text!r}: {part!r} is no number (give e.g. 4 or 2,4,8)") from None
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"--rate {text!r}: {part!r} is not a positive rate")
        if rate in rates:
            raise ValueError(f"--rate {text!r}: {part!r} is given twice")
        rates.append(rate)
    return rates


def step_folder(rate: float) -> str:
    return f"rate-{rate:g}"


def run_sweep(campaign: Campaign, rates: list[float]) -> tuple[list[dict[str, Any]], list[str]]:
    """Each rate's campaign under `campaign.out`, then the sweep's summary and report; (steps, breached gates)."""
    steps: list[dict[str, Any]] = []
    breached: list[str] = []
    for rate in rates:
        step = campaign.model_copy(update={"rate": rate, "out": campaign.out / step_folder(rate)})
        _, step_breaches = run(step)
        breached += [f"rate {rate:g}: {breach}" for breach in step_breaches]
        saved = json.loads((step.out / SUMMARY_FILE).read_text())
        figures = {name: saved.get(name) for name in STEP_FIGURES}
        steps.append({"rate": rate, "folder": step_folder(rate), **figures, "breached": step_breaches})
    sweep = {"rates": rates, "campaign": campaign.model_dump(mode="json", exclude={"rate"}), "steps": steps}
    (campaign.out / SUMMARY_FILE).write_text(json.dumps(sweep, indent=2))
    write_sweep_report(f"sluice load {campaign.workload} -> {campaign.target}: a rate sweep", steps, campaign.out)
    return steps, breached
