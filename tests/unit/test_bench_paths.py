"""`sluice bench paths`' summary: medians with min and max per figure, ratios to the replica port and to HAProxy alone,
and the tables."""

from __future__ import annotations

from sluice.bench.summary import FIGURES, proxy_table, summarize, table


def rounds_of(tokens_per_s: list[float], ttft_ms: list[float]) -> list[dict[str, float]]:
    return [
        {figure: (t if figure == "tokens_per_s" else f) for figure in FIGURES}
        for t, f in zip(tokens_per_s, ttft_ms, strict=True)
    ]


def test_medians_min_max_and_ratios_to_the_replica_port() -> None:
    rounds = {
        "replica_port": {"16": rounds_of([100, 120, 110], [10, 12, 11])},
        "direct": {"16": rounds_of([99, 90, 105], [12, 13, 30])},
    }
    summary = summarize(rounds)
    direct = summary["direct"]["16"]
    assert direct["tokens_per_s"] == {"median": 99, "min": 90, "max": 105, "ratio": 0.9, "proxy_ratio": None}
    assert direct["ttft_p50_ms"]["median"] == 13 and direct["ttft_p50_ms"]["ratio"] == 13 / 11
    assert summary["replica_port"]["16"]["tokens_per_s"]["ratio"] == 1.0
    rendered = table(summary)
    assert "direct" in rendered and "x0.90" in rendered


def test_ratios_to_haproxy_alone_beside_those_to_the_replica_port() -> None:
    rounds = {
        "replica_port": {"64": rounds_of([100, 100, 100], [10, 10, 10])},
        "haproxy_only": {"64": rounds_of([98, 97, 99], [12, 12, 12])},
        "direct": {"64": rounds_of([90, 90, 90], [15, 15, 15])},
    }
    direct = summarize(rounds)["direct"]["64"]
    assert direct["ttft_p50_ms"]["proxy_ratio"] == 15 / 12 and direct["ttft_p50_ms"]["ratio"] == 1.5
    assert direct["tokens_per_s"]["proxy_ratio"] == 90 / 98
    row = proxy_table(summarize(rounds)).splitlines()[1].split()
    assert row == ["64", "1.25", "1.50", f"{90 / 98:.2f}"]
