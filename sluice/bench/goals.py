"""The paths bench's goals, judged on one run's figures, and the direct path's overhead part by part. The goals are
aims for the benchmark, never asserted as timings in tests; they are listed in `sluice/bench/README.md`."""

from __future__ import annotations

from typing import Any

from routers.consistent_hash import NAME as CONSISTENT_HASH
from routers.round_robin import NAME as ROUND_ROBIN
from sluice.bench.overhead import DEFAULT_VARIANT, variant_label
from sluice.bench.summary import FIGURES, LIMIT_PATH, PROXY_LIMIT_PATH

TOKENS_RATIO_GOAL = 0.95
ADDED_MS_GOAL = 1.0
OVER_PYTHON_PATHS_GOAL = 3.0
ROUTE_P50_MS_GOAL = 0.3
ROUTE_P99_MS_GOAL = 1.5
# Against the limit a proxy can reach (HAProxy alone), where a burst of streams starts at once.
PROXY_TTFT_RATIO_GOAL = 1.1
PROXY_TOKENS_RATIO_GOAL = 0.97
PROXY_CASES = {"tiny": ("16", "64"), "zero": ("64x256",)}
ROUTER_CPU_US_GOAL = 50.0
CPU_POLICIES = (ROUND_ROBIN, CONSISTENT_HASH)
# Figures where more is better; every other figure is a latency.
HIGHER_IS_BETTER = {"tokens_per_s"}


def _median(summary: dict[str, Any], path: str, case: str, figure: str) -> float:
    return summary[path][case][figure]["median"]


def _worse(direct: float, peer: float, figure: str) -> bool:
    return direct < peer if figure in HIGHER_IS_BETTER else direct > peer


def judge(
    tiny: dict[str, Any], zero: dict[str, Any], variants: dict[str, Any], paired: dict[str, Any]
) -> list[tuple[str, str, bool | None]]:
    """(goal, what was measured, met) per goal; met is None where the run lacks the path (e.g. no peer) or the
    router variant. `variants`: the route call's figures per router variant (`variant_label`), per rate; `paired`:
    `direct` ÷ HAProxy alone per workload of `PROXY_CASES` (`summary.paired_ratios`)."""
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
    verdicts += _proxy_verdicts(paired)
    at_1000 = variants[DEFAULT_VARIANT]["1000"]
    met = at_1000["route_p50_ms"] <= ROUTE_P50_MS_GOAL and at_1000["route_p99_ms"] <= ROUTE_P99_MS_GOAL
    shown = f"p50 {at_1000['route_p50_ms']:.2f} ms, p99 {at_1000['route_p99_ms']:.2f} ms"
    verdicts.append(
        (f"route decision p50 ≤ {ROUTE_P50_MS_GOAL} ms, p99 ≤ {ROUTE_P99_MS_GOAL} ms at 1,000 req/s", shown, met)
    )
    cpu = {
        policy: variants[label]["1000"]["router_cpu_us_per_decision"]
        for policy in CPU_POLICIES
        if (label := variant_label(policy, 1, tables=True)) in variants
    }
    shown = ", ".join(f"{policy}: {value:.0f} µs" for policy, value in cpu.items()) or "not measured"
    met = all(v <= ROUTER_CPU_US_GOAL for v in cpu.values()) if len(cpu) == len(CPU_POLICIES) else None
    verdicts.append((f"router CPU per decision ≤ {ROUTER_CPU_US_GOAL:.0f} µs at 1,000 req/s", shown, met))
    return verdicts


def _proxy_verdicts(paired: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """TTFT p50 and tokens/s of `direct` against HAProxy alone, where a burst of streams starts: the median of the
    paired rounds' ratios (the measured text gives each one's 95 % interval beside it)."""
    cases = [(name, case) for name, labels in PROXY_CASES.items() for case in labels]
    ttft = {f"{n} {c}": paired[n][c]["ttft_p50_ms"] for n, c in cases}
    tokens = {f"{n} {c}": paired[n][c]["tokens_per_s"] for n, c in cases}
    return [
        (
            f"TTFT p50 direct ≤ {PROXY_TTFT_RATIO_GOAL}x {PROXY_LIMIT_PATH}",
            _ratios_text(ttft),
            all(r["median"] <= PROXY_TTFT_RATIO_GOAL for r in ttft.values()),
        ),
        (
            f"tokens/s direct ≥ {PROXY_TOKENS_RATIO_GOAL}x {PROXY_LIMIT_PATH}",
            _ratios_text(tokens),
            all(r["median"] >= PROXY_TOKENS_RATIO_GOAL for r in tokens.values()),
        ),
    ]


def _ratios_text(ratios: dict[str, dict[str, float]]) -> str:
    return ", ".join(f"{case}: x{r['median']:.2f} [{r['low']:.2f}-{r['high']:.2f}]" for case, r in ratios.items())


def breakdown(tiny: dict[str, Any], variants: dict[str, Any]) -> list[tuple[str, str]]:
    """Where the direct path's TTFT goes at one stream, part by part."""
    ttft = {path: _median(tiny, path, "1", "ttft_p50_ms") for path in (LIMIT_PATH, "haproxy_only", "direct")}
    rates = variants[DEFAULT_VARIANT]
    slowest = rates[min(rates, key=int)]
    return [
        ("TTFT p50 at the replica port (1 stream)", f"{ttft[LIMIT_PATH]:.1f} ms"),
        ("+ HAProxy alone (no Lua, no route call)", f"{ttft['haproxy_only'] - ttft[LIMIT_PATH]:+.1f} ms"),
        ("+ sluice's Lua action and its route decision", f"{ttft['direct'] - ttft['haproxy_only']:+.1f} ms"),
        (
            f"route decision as the Lua action times it ({DEFAULT_VARIANT}, {min(rates, key=int)} req/s)",
            f"p50 {slowest['route_p50_ms']:.2f} ms",
        ),
        ("router CPU per decision (its table's fetches)", f"{slowest['router_cpu_us_per_decision']:.0f} µs"),
    ]


def verdict_lines(verdicts: list[tuple[str, str, bool | None]]) -> str:
    marks = {True: "met", False: "NOT met", None: "n/a"}
    return "\n".join(f"  {marks[met]:<8}{goal}: {shown}" for goal, shown, met in verdicts)
