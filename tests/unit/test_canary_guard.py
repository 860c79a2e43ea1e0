"""The canary guard's measures and abort criteria, and the request log line they are read from."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from base.contracts import DIRECT_PATH, LEGACY_PATH, REASON_INJECTED_FAULT, REASON_ROUTER_UNREACHABLE
from base.quantiles import quantile
from infra.haproxy.canary import log_format
from loadtests.metrics import distribution
from services.frontend.canary_guard import AbortCriteria, RequestRecord, evaluate, measure
from services.frontend.path_log import MAX_RECORDS, PathLog, parse_record

CRITERIA = AbortCriteria(min_requests=10)
LIVE = ["r1", "r2"]


def record(
    path: str = DIRECT_PATH, status: int = 200, ttft_s: float = 0.05, termination: str = "--", **kw
) -> RequestRecord:
    fields = {"at": 0.0, "app": "a", "server": "r1", "served_replica": "r1", "request_id": "x"} | kw
    return RequestRecord(path=path, status=status, ttft_s=ttft_s, termination=termination, **fields)


def balanced(n: int, path: str = DIRECT_PATH, **kw) -> list[RequestRecord]:
    return [record(path, served_replica=LIVE[i % 2], **kw) for i in range(n)]


def test_a_healthy_direct_path_breaches_nothing_and_both_paths_are_measured() -> None:
    breach, direct, legacy = evaluate(CRITERIA, balanced(20) + balanced(8, LEGACY_PATH), LIVE)
    assert breach is None
    assert (direct.requests, legacy.requests) == (20, 8)
    assert direct.replica_imbalance == 1.0 and direct.ratio_503 == 0.0


@pytest.mark.parametrize(
    ("bad", "criterion"),
    [
        (dict(status=503, ttft_s=None, served_replica=None), "ratio_503"),
        (dict(ttft_s=30.0), "ttft_p99_s"),
        (dict(termination="SD"), "stream_error_ratio"),
    ],
)
def test_each_criterion_breaches_on_the_direct_path_with_its_value_and_threshold(bad: dict, criterion: str) -> None:
    records = balanced(18) + [record(**bad) for _ in range(2)]
    breach, _, _ = evaluate(CRITERIA, records, LIVE)
    assert breach is not None and breach.criterion == criterion
    assert breach.value > breach.threshold == CRITERIA.threshold(criterion)
    assert criterion in breach.describe()


def test_replica_imbalance_counts_live_replicas_that_served_nothing() -> None:
    records = [record(served_replica="r1") for _ in range(20)]
    breach, direct, _ = evaluate(AbortCriteria(min_requests=10, max_replica_imbalance=1.5), records, ["r1", "r2", "r3"])
    assert direct.replica_imbalance == 3.0
    assert breach is not None and breach.criterion == "replica_imbalance"


def test_injected_fault_503s_count_nowhere_but_real_503s_still_breach() -> None:
    # `sluice check`'s fault injection on a live canary: its 503s are no measure of the direct path.
    injected = [record(status=503, ttft_s=None, served_replica=None, reason=REASON_INJECTED_FAULT) for _ in range(5)]
    breach, direct, _ = evaluate(CRITERIA, balanced(18) + injected, LIVE)
    assert breach is None and direct.requests == 18 and direct.ratio_503 == 0.0
    # Not even toward `min_requests`: five injected faults and nine requests are still too few.
    assert evaluate(CRITERIA, injected + balanced(9), LIVE)[1].requests == 9
    real = [record(status=503, ttft_s=None, served_replica=None, reason=REASON_ROUTER_UNREACHABLE) for _ in range(2)]
    breach, direct, _ = evaluate(CRITERIA, balanced(18) + injected + real, LIVE)
    assert breach is not None and breach.criterion == "ratio_503" and direct.requests == 20
    assert breach.value == 2 / 20


def test_the_legacy_path_and_too_few_requests_never_breach() -> None:
    assert evaluate(CRITERIA, [record(LEGACY_PATH, status=503) for _ in range(50)], LIVE)[0] is None
    assert evaluate(CRITERIA, [record(status=503) for _ in range(9)], LIVE)[0] is None


def test_a_client_leaving_is_no_stream_error() -> None:
    assert measure(DIRECT_PATH, [record(termination="CD") for _ in range(10)], LIVE).stream_error_ratio == 0.0
    assert measure(DIRECT_PATH, [record(termination="SD") for _ in range(10)], LIVE).stream_error_ratio == 1.0


@pytest.mark.parametrize("samples", [7, 20, 101])
def test_the_canarys_ttft_p99_is_the_load_gates_on_the_same_samples(samples: int) -> None:
    rng = random.Random(samples)
    ttfts = [rng.uniform(0.01, 2.0) for _ in range(samples)]
    canary = measure(DIRECT_PATH, [record(ttft_s=t) for t in ttfts], LIVE).ttft_p99_s
    gate = distribution(ttfts)
    assert gate is not None and canary * 1000 == pytest.approx(gate.p99_ms, rel=1e-12)
    # Both are numpy's linear quantile, as `vllm bench serve`'s np.percentile: between the two largest of 20.
    assert canary == pytest.approx(float(np.percentile(ttfts, 99)), rel=1e-12)


def test_no_ttft_is_a_p99_of_0_and_a_quantile_outside_0_to_1_is_refused() -> None:
    assert measure(DIRECT_PATH, [record(ttft_s=None)], LIVE).ttft_p99_s == 0.0
    with pytest.raises(ValueError):
        quantile([1.0], 99)
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_a_log_line_in_the_rendered_format_parses_into_a_record() -> None:
    # The format's fields, in order, as HAProxy fills them in.
    fields = ["app-llm", "direct", "200", "42", "1200", "--", "r1", "r1", "850", "-", "req 1"]
    line = log_format("txn.id", "txn.reason").split(" ")[0] + " " + " ".join(fields)
    assert len(log_format("txn.id", "txn.reason").split(" ")) == len(fields) + 1
    assert log_format("txn.id", "txn.reason").split(" ")[-2:] == ["%[var(txn.reason)]", "%[var(txn.id)]"]
    parsed = parse_record(line + "\n", at=5.0)
    assert parsed == RequestRecord(
        at=5.0,
        app="app-llm",
        path="direct",
        status=200,
        ttft_s=0.042,
        termination="--",
        server="r1",
        served_replica="r1",
        request_id="req 1",
        route_s=0.00085,
    )
    legacy = parse_record(line.replace(" 850 ", " - "), at=5.0)
    assert legacy is not None and legacy.route_s is None
    failed = parse_record(line.replace(" 200 ", " 503 ").replace(" - req", f" {REASON_INJECTED_FAULT} req"), at=5.0)
    assert failed is not None and failed.reason == REASON_INJECTED_FAULT and failed.status == 503


@pytest.mark.parametrize(
    "line",
    [
        "",
        "garbage",
        "sluice a - 200 1 1 -- r r - - id",
        "sluice a direct x 1 1 -- r r - - id",
        "sluice a direct 200 1 1 -- r r x - id",
        "sluice a direct 200 1 1 -- r r - id",
        # numbers the log's int columns cannot hold
        "sluice a direct 2147483648 1 1 -- r r 700 - id",
        "sluice a direct 200 99999999999 1 -- r r 700 - id",
        "sluice a direct 200 1 1 -- r r 99999999999 - id",
        "sluice a direct -7 1 1 -- r r 700 - id",
    ],
)
def test_lines_that_are_no_path_record_are_ignored(line: str) -> None:
    assert parse_record(line, at=0.0) is None


def test_the_log_keeps_records_by_age() -> None:
    now = [0.0]
    log = PathLog(clock=lambda: now[0])
    for t in (1.0, 2.0, 3.0):
        now[0] = t
        log.datagram_received(f"sluice a direct 200 1 1 -- r r 700 - id{t}".encode(), None)
    assert [r.request_id for r in log.records_since(2.0)] == ["id3.0", "id2.0"]
    assert [r.at for r in log.find({"id1.0"})] == [1.0]


def test_reads_from_another_thread_while_records_arrive_all_answer() -> None:
    """The frontend reads its full log from Serve's thread while its background loop appends (review finding #1: a
    deque iterated during an append raised in 20 of 20 reads at 100 records/s)."""
    log = PathLog()
    for i in range(MAX_RECORDS):
        log.add(RequestRecord(0.0, "a", "direct", 200, 0.01, "--", "r", "r", f"id{i}"))
    assert len(log) == MAX_RECORDS
    stop = threading.Event()

    def arrive() -> None:
        while not stop.is_set():
            log.datagram_received(b"sluice a direct 200 1 1 -- r r 700 - late", None)

    writer = threading.Thread(target=arrive)
    writer.start()
    try:
        answered = 0
        for _ in range(20):
            window = log.records_since(time.monotonic() - 10)
            assert window and all(record.request_id == "late" for record in window)
            assert log.find({"late"})
            answered += 1
    finally:
        stop.set()
        writer.join(timeout=10)
    assert answered == 20
