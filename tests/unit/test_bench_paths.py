"""`sluice bench paths`' summary: medians with min and max per figure, ratios to the replica port and to HAProxy alone,
`direct` against HAProxy alone within paired rounds, and the tables."""

from __future__ import annotations

import pytest

from loadtests.stream_probe import StreamResult
from sluice.bench.paths import SPREAD_FROM_STREAMS, STEADY_LENGTH_FACTORS, steady_figures, steady_lengths
from sluice.bench.summary import FIGURES, paired_ratios, proxy_table, summarize, table


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


def test_direct_against_haproxy_alone_is_the_median_ratio_within_pairs() -> None:
    # The machine drifts between pairs (TTFT 10, 20, 40 ms): within each pair direct is 1.1, 1.0 or 1.2 times HAProxy
    # alone, while the medians of each path's rounds would say 20 / 20 = 1.0.
    limit = rounds_of([100, 50, 25], [10, 20, 40])
    direct = rounds_of([95, 50, 20], [11, 20, 48])
    ratios = paired_ratios({"64": list(zip(limit, direct, strict=True))})["64"]
    # Three pairs are too few for a 95 % interval of the median: it is their min and max.
    assert ratios["ttft_p50_ms"] == {"median": 1.1, "low": 1.0, "high": 1.2, "min": 1.0, "max": 1.2, "pairs": 3}
    assert ratios["tokens_per_s"] == {"median": 0.95, "low": 0.8, "high": 1.0, "min": 0.8, "max": 1.0, "pairs": 3}
    summary = summarize({"replica_port": {"64": rounds_of([100] * 3, [10] * 3)}, "direct": {"64": direct}})
    row = proxy_table(summary, {"64": ratios}).splitlines()[1].split()
    assert row == ["64", "1.10", "[1.00-1.20]", "2.00", "0.95", "[0.80-1.00]"]


def test_the_interval_of_24_pairs_leaves_out_their_outliers() -> None:
    limit = rounds_of([100] * 24, [10] * 24)
    ttfts = [10 * (1 + i / 100) for i in range(24)]  # ratios 1.00 .. 1.23
    ttfts[0], ttfts[-1] = 5, 40  # a pair each way that the machine threw off
    ratios = paired_ratios({"64": list(zip(limit, rounds_of([100] * 24, ttfts), strict=True))})["64"]["ttft_p50_ms"]
    assert (ratios["min"], ratios["max"]) == (0.5, 4.0)
    assert (ratios["low"], ratios["high"]) == (1.06, 1.17)


def test_a_steady_round_times_every_request_but_each_streams_first_and_counts_every_token() -> None:
    def stream(ttft_s: float) -> StreamResult:
        return StreamResult(headers_s=ttft_s, ttft_s=ttft_s, total_s=ttft_s + 1, completion_tokens=10)

    # The first wave of a round arrives together and waits for the engine's step: 1 s here, 0.1-0.3 s after it.
    per_stream = [[stream(1.0), stream(0.1), stream(0.2)], [stream(1.0), stream(0.3), stream(0.2)]]
    figures = steady_figures(per_stream, wall=4.0)
    assert figures["ttft_p50_ms"] == 200 and figures["ttft_p99_ms"] < 1000
    assert figures["tokens_per_s"] == 60 / 4.0


def test_steady_lengths_spread_each_wave_from_64_streams_and_keep_the_cases_mean() -> None:
    streams = [steady_lengths(i, SPREAD_FROM_STREAMS, 64) for i in range(SPREAD_FROM_STREAMS)]
    assert all(len(set(lengths)) == len(lengths) for lengths in streams)
    for wave in zip(*streams, strict=True):
        assert len(set(wave)) == len(STEADY_LENGTH_FACTORS)
        assert sum(wave) / len(wave) == pytest.approx(64, rel=0.02)
    assert {n for i in range(16) for n in steady_lengths(i, 16, 64)} == {64}
