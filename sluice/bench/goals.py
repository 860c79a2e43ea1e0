"""The paths bench's goals, judged on one run's figures, and the direct path's overhead part by part. The goals are
aims for the benchmark, never asserted as timings in tests; they are listed in `sluice/bench/README.md`."""

from __future__ import annotations

from typing import Any

from sluice.bench.summary import FIGURES, LIMIT_PATH

TOKENS_RATIO_GOAL = 0.95
ADDED_MS_GOAL = 1.0
OVER_PYTHON_PATHS_GOAL = 3.0
ROUTE_P50_MS_GOAL = 0.5
ROUTE_P99_MS_GOAL = 2.0
# Figures where more is better; every other figure is a latency.
HIGHER_IS_BETTER = {"tokens_per_s"}


def _median(summary: dict[str, Any], path: str, case: str, figure: str) -> float:
    return summary[path][case][figure]["median"]


def _worse(direct: float, peer: float, figure: str) -> bool:
    return direct < peer if figure in HIGHER_IS_BETTER else direct > peer


def judge(tiny: dict[str, Any], zero: dict[str, Any], rates: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """(goal, what was measured, met) per goal; met is None where the run lacks the path (e.g. no peer)."""
    verdicts: list[tuple[str, str, bool | None]] = []
    ratio = tiny["direct"]["64"]["tokens_per_s"]["ratio"]
    verdicts.append(
        (f"tokens/s direct/replica ≥ {TOKENS_RATIO_GOAL} at 64 streams", f"{ratio:.2f}", ratio >= TOKENS_RATIO_GOAL)
    )
    for figure in ("ttft_p50_ms", "itl_p99_ms"):
        added = {
            case: _median(tiny, "direct", case, figure) - _median(tiny, LIMIT_PATH, case, figure)
            for case in tiny["direct"]
        }
        shown = ", ".join(f"{case}: {value:+.1f}" for case, value in added.items())
        verdicts.append(
            (f"{figure} added ≤ {ADDED_MS_GOAL} ms", shown, all(v <= ADDED_MS_GOAL for v in added.values()))
        )
    if "ray_peer" in tiny:
        worse = [
            f"{figure}@{case}"
            for case in tiny["direct"]
            for figure in FIGURES
            if _worse(_median(tiny, "direct", case, figure), _median(tiny, "ray_peer", case, figure), figure)
        ]
        shown = "worse: " + (", ".join(worse) or "none")
        verdicts.append(("direct ≥ Ray's HAProxy peer on every figure", shown, not worse))
    else:
        verdicts.append(("direct ≥ Ray's HAProxy peer on every figure", "peer not measured", None))
    for other in ("legacy", "serve_proxy"):
        times = {
            case: zero["direct"][case]["tokens_per_s"]["median"] / zero[other][case]["tokens_per_s"]["median"]
            for case in zero["direct"]
        }
        shown = ", ".join(f"{case}: x{value:.1f}" for case, value in times.items())
        verdicts.append(
            (
                f"direct ≥ {OVER_PYTHON_PATHS_GOAL}x {other} tokens/s (zero compute)",
                shown,
                all(v >= OVER_PYTHON_PATHS_GOAL for v in times.values()),
            )
        )
    at_1000 = rates["1000"]
    met = at_1000["route_p50_ms"] <= ROUTE_P50_MS_GOAL and at_1000["route_p99_ms"] <= ROUTE_P99_MS_GOAL
    shown = f"p50 {at_1000['route_p50_ms']:.2f} ms, p99 {at_1000['route_p99_ms']:.2f} ms"
    verdicts.append(
        (f"route call p50 ≤ {ROUTE_P50_MS_GOAL} ms, p99 ≤ {ROUTE_P99_MS_GOAL} ms at 1,000 req/s", shown, met)
    )
    return verdicts


def breakdown(tiny: dict[str, Any], rates: dict[str, Any]) -> list[tuple[str, str]]:
    """Where the direct path's TTFT goes at one stream, part by part."""
    ttft = {path: _median(tiny, path, "1", "ttft_p50_ms") for path in (LIMIT_PATH, "haproxy_only", "direct")}
    slowest = rates[min(rates, key=int)]
    return [
        ("TTFT p50 at the replica port (1 stream)", f"{ttft[LIMIT_PATH]:.1f} ms"),
        ("+ HAProxy alone (no Lua, no route call)", f"{ttft['haproxy_only'] - ttft[LIMIT_PATH]:+.1f} ms"),
        ("+ sluice's Lua action, route call and router", f"{ttft['direct'] - ttft['haproxy_only']:+.1f} ms"),
        (
            f"route call as the Lua action times it ({min(rates, key=int)} req/s)",
            f"p50 {slowest['route_p50_ms']:.2f} ms",
        ),
        ("router CPU per decision (route listener, answer)", f"{slowest['router_cpu_us_per_decision']:.0f} µs"),
    ]


def verdict_lines(verdicts: list[tuple[str, str, bool | None]]) -> str:
    marks = {True: "met", False: "NOT met", None: "n/a"}
    return "\n".join(f"  {marks[met]:<8}{goal}: {shown}" for goal, shown, met in verdicts)
