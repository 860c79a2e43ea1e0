"""The paths bench judges each goal from the run's own figures: a goal flips when its figure crosses the bound."""

from __future__ import annotations

from sluice.bench.goals import breakdown, judge
from sluice.bench.summary import FIGURES, summarize


def rounds(tokens_per_s: float, latency_ms: float) -> list[dict[str, float]]:
    return [{f: (tokens_per_s if f == "tokens_per_s" else latency_ms) for f in FIGURES}] * 3


def tiny(direct_tokens: float, direct_ms: float, peer_ms: float) -> dict:
    cases = ("1", "16", "64")
    return summarize(
        {
            "replica_port": {c: rounds(1000, 10.0) for c in cases},
            "haproxy_only": {c: rounds(990, 10.2) for c in cases},
            "direct": {c: rounds(direct_tokens, direct_ms) for c in cases},
            "ray_peer": {c: rounds(900, peer_ms) for c in cases},
        }
    )


def zero(direct_tokens: float) -> dict:
    cases = ("64x16", "64x256")
    paths = {"replica_port": 5000.0, "direct": direct_tokens, "legacy": 1000.0, "serve_proxy": 1500.0}
    return summarize({p: {c: rounds(t, 50.0) for c in cases} for p, t in paths.items()})


RATES = {"100": {"route_p50_ms": 0.3, "route_p99_ms": 1.0, "router_cpu_us_per_decision": 90.0}}


def verdicts(direct_tokens: float, direct_ms: float, peer_ms: float, zero_tokens: float, p99: float) -> dict:
    rates = {**RATES, "1000": {"route_p50_ms": 0.4, "route_p99_ms": p99, "router_cpu_us_per_decision": 80.0}}
    return {goal: met for goal, _, met in judge(tiny(direct_tokens, direct_ms, peer_ms), zero(zero_tokens), rates)}


def test_every_goal_met_and_each_one_missed_on_its_own() -> None:
    assert all(verdicts(980, 10.5, 12.0, 4800, 1.5).values())
    missed = {
        "tokens": verdicts(900, 10.5, 12.0, 4800, 1.5),
        "added": verdicts(980, 11.5, 12.0, 4800, 1.5),
        "peer": verdicts(980, 10.5, 10.2, 4800, 1.5),
        "python paths": verdicts(980, 10.5, 12.0, 4000, 1.5),
        "route": verdicts(980, 10.5, 12.0, 4800, 2.5),
    }
    assert [g for g, met in missed["tokens"].items() if not met] == ["tokens/s direct/replica ≥ 0.95 at 64 streams"]
    assert {g for g, met in missed["added"].items() if not met} == {
        "ttft_p50_ms added ≤ 1.0 ms",
        "itl_p99_ms added ≤ 1.0 ms",
    }
    assert [g for g, met in missed["peer"].items() if not met] == ["direct ≥ Ray's HAProxy peer on every figure"]
    assert [g for g, met in missed["python paths"].items() if not met] == [
        "direct ≥ 3.0x serve_proxy tokens/s (zero compute)"
    ]
    assert [g for g, met in missed["route"].items() if not met] == [
        "route call p50 ≤ 0.5 ms, p99 ≤ 2.0 ms at 1,000 req/s"
    ]


def test_without_the_peer_its_goal_is_not_judged_and_the_breakdown_adds_up() -> None:
    summary = tiny(980, 10.5, 12.0)
    del summary["ray_peer"]
    rates = {**RATES, "1000": RATES["100"]}
    assert {met for goal, _, met in judge(summary, zero(4800), rates) if "peer" in goal} == {None}
    parts = dict(breakdown(summary, rates))
    assert parts["+ HAProxy alone (no Lua, no route call)"] == "+0.2 ms"
    assert parts["+ sluice's Lua action, route call and router"] == "+0.3 ms"
