"""The routing suite's prefix-reuse figures from hand-made rows: the ideal hit rates the workloads allow and each
replica's in-flight requests over time."""

from __future__ import annotations

import pytest

from loadtests.sse_timing import StreamRow
from sluice.bench.prefix_reuse import (
    hit_rate,
    ideal_multi_turn_rate,
    ideal_shared_prefix_rate,
    in_flight,
    small_cache,
)


def _row(session: str, sent_at: float, e2el_s: float = 1.0, replica: str = "a", **fields: object) -> StreamRow:
    row = StreamRow("test", session, sent_at, sent_at, status=200, e2el_s=e2el_s, replica=replica)
    for name, value in fields.items():
        setattr(row, name, value)
    return row


def test_a_perfect_shared_cache_misses_each_system_prompt_once_and_then_reuses_its_tokens() -> None:
    rows = [
        _row("prompt0-seed1/b", 2.0, prompt_tokens=440),
        _row("prompt0-seed1/a", 1.0, prompt_tokens=440),  # the first use, though listed second
        _row("prompt1-seed1/c", 3.0, prompt_tokens=440),
        _row("prompt0-seed1/d", 4.0, prompt_tokens=440),
        _row("prompt1-seed1/e", 5.0, prompt_tokens=440, status=503),  # failed: neither a use nor a reuse
    ]
    assert ideal_shared_prefix_rate(rows, system_prompt_tokens=384) == pytest.approx(2 * 384 / (4 * 440))
    assert ideal_shared_prefix_rate(rows, 100, system_prompt_tokens=384) == pytest.approx(2 * 300 / (4 * 440))
    assert ideal_shared_prefix_rate([]) == 0.0


def test_the_hot_prefix_session_is_its_system_prompts_key() -> None:
    rows = [_row("prompt0-seed1", float(at), prompt_tokens=400) for at in range(4)]
    assert ideal_shared_prefix_rate(rows, system_prompt_tokens=384) == pytest.approx(3 * 384 / 1600)


def test_a_turn_reuses_what_its_previous_turn_computed_in_whole_blocks() -> None:
    rows = [
        _row("s", 1.0, prompt_tokens=50, output_tokens=30),
        _row("s", 2.0, prompt_tokens=130, output_tokens=30, reusable_tokens=70),
        _row("t", 1.5, prompt_tokens=50, output_tokens=30),
        _row("t", 2.5, prompt_tokens=130, reusable_tokens=120, status=503),  # failed: neither a use nor a reuse
    ]
    assert ideal_multi_turn_rate(rows) == pytest.approx(70 / 230)
    assert ideal_multi_turn_rate(rows, block_size=32) == pytest.approx(64 / 230), "whole blocks only"
    assert ideal_multi_turn_rate([]) == 0.0


def test_in_flight_peaks_and_time_averages_per_replica_with_idle_replicas_counted() -> None:
    rows = [
        _row("1", 0.0, 2.0, "a"),
        _row("2", 1.0, 2.0, "a"),
        _row("3", 3.0, 1.0, "a"),  # starts as request 2 ends: not concurrent with it
        _row("4", 0.0, 4.0, "b"),
        _row("5", 0.5, 9.0, "b", status=503),  # failed: no load counted
    ]
    found = in_flight(rows, replicas=3)
    assert found["max"] == {"a": 2, "b": 1}
    assert found["mean"] == pytest.approx({"a": 5 / 4, "b": 1.0})
    assert found["mean_all"] == pytest.approx(9 / 4 / 3)  # the third replica served nothing
    assert found["max_over_mean"] == pytest.approx(2 / 0.75)
    assert found["busiest_over_mean"] == pytest.approx(1.25 / 0.75)


def test_perfectly_spread_load_has_a_ratio_of_one() -> None:
    rows = [_row(str(i), float(i // 3), 1.0, "abc"[i % 3]) for i in range(30)]
    found = in_flight(rows, replicas=3)
    assert found["max_over_mean"] == pytest.approx(1.0) and found["busiest_over_mean"] == pytest.approx(1.0)


def test_no_served_rows_give_zero_load() -> None:
    assert in_flight([_row("1", 0.0, status=503)], replicas=3)["max_over_mean"] == 0.0


def test_the_hit_rate_counts_replicas_started_between_readings_from_zero_and_leaves_out_stopped_ones() -> None:
    before = {"kept": (100.0, 400.0), "stopped": (50.0, 60.0)}
    after = {"kept": (160.0, 500.0), "started": (30.0, 100.0)}
    assert hit_rate(before, after) == pytest.approx((60 + 30) / (100 + 100))
    assert hit_rate(before, before) == 0.0


def test_the_sections_cache_holds_a_quarter_more_than_a_full_length_request_unless_the_spec_sizes_it() -> None:
    assert small_cache({"block_size": 32}) == {
        "num_gpu_blocks_override": 40,
        "enable_prompt_tokens_details": True,
        "block_size": 32,
    }
    assert small_cache({"block_size": 16, "max_model_len": 1000})["num_gpu_blocks_override"] == 79
    assert small_cache({})["num_gpu_blocks_override"] == 10, "vLLM's CPU block size (128) when unset"
    assert small_cache({"num_gpu_blocks_override": 99})["num_gpu_blocks_override"] == 99
