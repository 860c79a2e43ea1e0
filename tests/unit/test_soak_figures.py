"""The soak's judgement of its requests: a request with no response is lost with the killed replica only when its
connection closed without one around the kill; anything else without a response, and any non-2xx without a reason,
breaks an invariant; in a run long enough to judge memory, the data plane's RSS may grow 5 % after the warm-up."""

from __future__ import annotations

from loadtests.sse_timing import StreamRow
from sluice.bench.soak import CLOSED_WITHOUT_RESPONSE, MEMORY_JUDGED_FROM_S, broken_invariants, request_figures

KILL_WINDOW = (100.0, 110.0)


def row(sent_at: float, status: int, error: str = "", reason: str = "") -> StreamRow:
    return StreamRow("mixed", "s", sent_at, sent_at, status=status, error=error, reason=reason)


def judged(rows: list[StreamRow]) -> tuple[dict, list[str]]:
    figures = {**request_figures(rows, KILL_WINDOW), "ledger_outstanding": 0, "servers_match": True}
    return figures, broken_invariants(figures)


def test_a_connection_closed_without_a_response_at_the_kill_is_lost_with_the_replica() -> None:
    figures, broken = judged(
        [
            row(50.0, 200),
            row(104.0, 200, error="ChunkedEncodingError"),
            row(105.0, 0, error=CLOSED_WITHOUT_RESPONSE),
            row(106.0, 503, reason="no_replica"),
        ]
    )
    assert figures["lost_at_kill"] == 1 and figures["cut_streams"] == 1 and figures["no_response"] == {}
    assert figures["non_2xx"] == {"503 no_replica": 1} and figures["requests"] == 4
    assert broken == []


def test_no_response_away_from_the_kill_or_a_hang_and_a_reasonless_5xx_break_invariants() -> None:
    figures, broken = judged(
        [
            row(99.0, 0, error=CLOSED_WITHOUT_RESPONSE),
            row(105.0, 0, error="ReadTimeout"),
            row(120.0, 502),
        ]
    )
    assert figures["lost_at_kill"] == 0
    assert figures["no_response"] == {CLOSED_WITHOUT_RESPONSE: 1, "ReadTimeout": 1}
    assert len(broken) == 2 and "502 -" in broken[0] and "ReadTimeout" in broken[1]
    assert broken_invariants({**figures, "no_response": {}, "non_2xx": {}, "ledger_outstanding": 2}) == [
        "the capacity ledger still holds 2 tokens"
    ]


def test_the_data_planes_memory_may_grow_5_percent_after_the_warm_up_in_a_long_run() -> None:
    """Judged on private memory: HAProxy's resident pages grew 10 % (code paged in), its private ones 2.5 %."""
    rss = {
        "haproxy": {"start": 10.0, "warm": 10.0, "end": 11.0, "private_warm": 4.0, "private_end": 4.1},
        "router:12": {"start": 200.0, "warm": 250.0, "end": 270.0, "private_warm": 200.0, "private_end": 216.0},
        "replica:13": {"start": 1000.0, "warm": 1200.0, "end": 1500.0, "private_warm": 900.0, "private_end": 1200.0},
    }
    figures = {**judged([row(1.0, 200)])[0], "rss_mb": rss}
    assert broken_invariants({**figures, "duration_s": MEMORY_JUDGED_FROM_S}) == [
        "router:12's private memory grew 8.0 % after the warm-up (200.0 -> 216.0 MB)"
    ]
    assert broken_invariants({**figures, "duration_s": 90}) == []
