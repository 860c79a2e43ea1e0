"""The request log's store: every field read back as written, the oldest record overwritten when full, and memory
that does not grow with the traffic (review of the 30-minute soak: the frontend grew 12 MB after its warm-up)."""

from __future__ import annotations

import tracemalloc
import uuid

from services.frontend.canary_guard import RequestRecord
from services.frontend.path_log import PathLog
from services.frontend.record_ring import ID_BYTES, RecordRing


def record(i: int, server: str = "r1", **kw) -> RequestRecord:
    fields = {
        "at": float(i),
        "app": "team-chat",
        "path": "direct",
        "status": 200,
        "ttft_s": 0.123,
        "termination": "----",
        "server": server,
        "served_replica": server,
        "request_id": f"id{i}",
        "route_s": 0.000812,
        "reason": None,
    }
    return RequestRecord(**(fields | kw))


def test_every_field_reads_back_as_written_none_included() -> None:
    ring = RecordRing(4)
    written = [
        record(1),
        record(2, status=503, ttft_s=None, served_replica=None, route_s=None, reason="no_replica", path="legacy"),
        record(3, status=-1, termination="CD--", server="<NOSRV>", request_id=""),
    ]
    for one in written:
        ring.append(one)
    assert list(ring.newest_since(0.0)) == written[::-1]
    assert list(ring.newest_since(2.0)) == written[:0:-1]


def test_the_oldest_record_is_overwritten_once_full() -> None:
    ring = RecordRing(3)
    for i in range(7):
        ring.append(record(i))
    assert len(ring) == 3
    assert [r.request_id for r in ring.newest_since(0.0)] == ["id6", "id5", "id4"]
    assert ring.find(["id3", "id5", "id4"]) == [record(4), record(5)]


def test_a_request_id_too_long_to_keep_is_found_by_the_id_it_was_sent_with() -> None:
    ring = RecordRing(4)
    long_id, short_id = "x" * (ID_BYTES + 1), "y" * ID_BYTES
    ring.append(record(1, request_id=long_id))
    ring.append(record(2, request_id=short_id))
    [kept_long, kept_short] = ring.find([long_id, short_id, "x" * (ID_BYTES + 2)])
    assert (kept_long.request_id, kept_short.request_id) == (long_id, short_id)
    assert [r.request_id for r in ring.newest_since(0.0)][1].startswith("sha1:")


def test_names_no_record_holds_any_more_are_dropped() -> None:
    """Replicas come and go for months: their names must not pile up in the label table."""
    ring = RecordRing(10)
    for generation in range(50):
        for i in range(10):
            ring.append(record(i, server=f"replica-{generation}-{i % 3}"))
    # app, path, termination and the last generation's three replica names
    assert ring.distinct_labels == 3 + 3


def test_a_full_log_costs_what_an_empty_one_does() -> None:
    """Three times its capacity of records with unique ids grow its memory by less than 1 byte per record held
    (as objects a record cost ~620 B: a full log was ~120 MB)."""
    capacity = 5_000
    tracemalloc.start()
    try:
        log = PathLog(capacity=capacity)
        empty, _ = tracemalloc.get_traced_memory()
        for i in range(3 * capacity):
            log.add(record(i, server=f"r{i % 3}", request_id=str(uuid.uuid4())))
        full, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(log) == capacity
    assert full - empty < capacity, f"{(full - empty) / capacity:.1f} B per record"
