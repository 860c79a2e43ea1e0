"""The paths bench judges each goal from the run's own figures: a goal flips when its figure crosses the bound."""

from __future__ import annotations

from sluice.bench.goals import breakdown, judge
from sluice.bench.overhead import DEFAULT_VARIANT, variant_label
from sluice.bench.summary import FIGURES, paired_ratios, summarize


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
    paths = {"replica_port": 5000.0, "haproxy_only": 4900.0, "direct": direct_tokens, "legacy": 1000.0}
    return summarize({p: {c: rounds(t, 50.0) for c in cases} for p, t in {**paths, "serve_proxy": 1500.0}.items()})


def paired(direct_tokens: float, direct_ms: float, zero_tokens: float) -> dict:
    """Direct against HAProxy alone (990 tok/s and 10.2 ms on the tiny model, 4900 tok/s and 50 ms on zero compute)
    in three pairs of rounds per case."""
    tiny_pair = (rounds(990, 10.2)[0], rounds(direct_tokens, direct_ms)[0])
    zero_pair = (rounds(4900, 50.0)[0], rounds(zero_tokens, 50.0)[0])
    return {
        "tiny": paired_ratios({c: [tiny_pair] * 3 for c in ("16", "64")}),
        "zero": paired_ratios({"64x256": [zero_pair] * 3}),
    }


RATES = {"100": {"route_p50_ms": 0.2, "route_p99_ms": 1.0, "router_cpu_us_per_decision": 90.0}}


def verdicts(
    direct_tokens: float, direct_ms: float, peer_ms: float, zero_tokens: float, p99: float, cpu_us: float = 40.0
) -> dict:
    at_1000 = {"route_p50_ms": 0.25, "route_p99_ms": p99, "router_cpu_us_per_decision": cpu_us}
    variants = {
        DEFAULT_VARIANT: {**RATES, "1000": at_1000},
        variant_label("consistent_hash", 1, tables=True): {
            **RATES,
            "1000": {**at_1000, "router_cpu_us_per_decision": 45.0},
        },
    }
    summaries = tiny(direct_tokens, direct_ms, peer_ms), zero(zero_tokens)
    return {goal: met for goal, _, met in judge(*summaries, variants, paired(direct_tokens, direct_ms, zero_tokens))}


def test_every_goal_met_and_each_one_missed_on_its_own() -> None:
    assert all(verdicts(980, 10.5, 12.0, 4800, 1.2).values())
    missed = {
        "tokens": verdicts(900, 10.5, 12.0, 4800, 1.2),
        "added": verdicts(980, 11.5, 12.0, 4800, 1.2),
        "peer": verdicts(980, 10.5, 10.2, 4800, 1.2),
        "python paths": verdicts(980, 10.5, 12.0, 4000, 1.2),
        "route": verdicts(980, 10.5, 12.0, 4800, 2.5),
        "cpu": verdicts(980, 10.5, 12.0, 4800, 1.2, cpu_us=60.0),
    }
    assert {g for g, met in missed["tokens"].items() if not met} == {
        "tokens/s direct/replica ≥ 0.95 at 64 streams",
        "tokens/s direct ≥ 0.97x haproxy_only",
    }
    assert {g for g, met in missed["added"].items() if not met} == {
        "ttft_p50_ms added ≤ 1.0 ms",
        "itl_p99_ms added ≤ 1.0 ms",
        "TTFT p50 direct ≤ 1.1x haproxy_only",
    }
    assert [g for g, met in missed["peer"].items() if not met] == ["direct ≥ Ray's HAProxy peer on every figure"]
    assert {g for g, met in missed["python paths"].items() if not met} == {
        "direct ≥ 3.0x serve_proxy tokens/s (zero compute)",
        "tokens/s direct ≥ 0.97x haproxy_only",
    }
    assert [g for g, met in missed["route"].items() if not met] == [
        "route decision p50 ≤ 0.3 ms, p99 ≤ 1.5 ms at 1,000 req/s"
    ]
    assert [g for g, met in missed["cpu"].items() if not met] == ["router CPU per decision ≤ 50 µs at 1,000 req/s"]


def test_without_the_peer_its_goal_is_not_judged_and_the_breakdown_adds_up() -> None:
    summary = tiny(980, 10.5, 12.0)
    del summary["ray_peer"]
    variants = {DEFAULT_VARIANT: {**RATES, "1000": RATES["100"]}}
    judged = {goal: met for goal, _, met in judge(summary, zero(4800), variants, paired(980, 10.5, 4800))}
    assert {met for goal, met in judged.items() if "peer" in goal} == {None}
    assert judged["router CPU per decision ≤ 50 µs at 1,000 req/s"] is None, "consistent_hash was not measured"
    parts = dict(breakdown(summary, variants))
    assert parts["+ HAProxy alone (no Lua, no route call)"] == "+0.2 ms"
    assert parts["+ sluice's Lua action and its route decision"] == "+0.3 ms"
