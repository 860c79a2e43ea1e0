"""A fixed number of request records in columns allocated up front: a full log costs what an empty one does.

Why: as objects a record cost ~620 B (a frozen dataclass, three floats, seven strings), so 200,000 of them were
~120 MB the frontend grew into over hours of traffic (a 30-minute soak: +12 MB after its warm-up, +5.9 %). Here a
slot is `SLOT_BYTES` bytes of preallocated columns:
- when it arrived (float64); status, ms to the response headers and µs of the route call (int32; -1 for none);
- app, path, termination state, server, served replica and reason as indices (uint32) into a table of their distinct
  strings; each string is counted by the slots that name it and dropped when none does (they are HAProxy's names:
  a handful per stack, however long it runs and however often replicas are replaced);
- the request id: its UTF-8 when it fits `ID_BYTES` (a generated one is a 36-character UUID), else its SHA-1
  (a client may send any `x-request-id`); such a record reads back as `sha1:<hex>`, and `find` matches it by the
  id it was sent with.
The oldest slot is overwritten once all are taken. Not thread-safe: `PathLog` holds a lock around every call.
"""

from __future__ import annotations

import dataclasses
import hashlib
from array import array
from collections.abc import Iterable, Iterator

from services.frontend.canary_guard import RequestRecord

# A request id of up to this many UTF-8 bytes is kept as sent; a longer one by its SHA-1 digest.
ID_BYTES = 40
_ID_SLOT_BYTES = 1 + ID_BYTES  # a length byte (or `_DIGEST`), then the id's bytes
_DIGEST = 0xFF
_NONE = -1  # "no value" in the int columns (no response headers, no route call)
_LABELS = ("app", "path", "termination", "server", "served_replica", "reason")
# What one slot costs: when (8), status and two durations (3 x 4), the labels (4 each) and the id.
SLOT_BYTES = 8 + 3 * 4 + 4 * len(_LABELS) + _ID_SLOT_BYTES
# The largest value the int columns hold (HAProxy's status codes, ms and µs are far below it).
INT_COLUMN_MAX = 2**31 - 1


class _CountedStrings:
    """Distinct strings by index, each counted by its holders; index 0 is None and is never counted."""

    def __init__(self) -> None:
        self._index: dict[str, int] = {}
        self._values: list[str | None] = [None]
        self._holders: list[int] = [0]
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._index)

    def hold(self, value: str | None) -> int:
        if value is None:
            return 0
        index = self._index.get(value)
        if index is None:
            index = self._free.pop() if self._free else len(self._values)
            if index == len(self._values):
                self._values.append(value)
                self._holders.append(0)
            else:
                self._values[index] = value
            self._index[value] = index
        self._holders[index] += 1
        return index

    def release(self, index: int) -> None:
        if index == 0:
            return
        self._holders[index] -= 1
        if self._holders[index] == 0:
            del self._index[self._values[index]]  # type: ignore[arg-type]
            self._values[index] = None
            self._free.append(index)

    def value(self, index: int) -> str | None:
        return self._values[index]


def _id_slot(request_id: str) -> bytes:
    """The id as its slot holds it: length byte and UTF-8 when it fits, else the digest marker and SHA-1."""
    raw = request_id.encode("utf-8", "surrogateescape")
    if len(raw) <= ID_BYTES:
        return bytes([len(raw)]) + raw.ljust(ID_BYTES, b"\0")
    return bytes([_DIGEST]) + hashlib.sha1(raw).digest().ljust(ID_BYTES, b"\0")


def _id_from_slot(slot: bytes) -> str:
    if slot[0] == _DIGEST:
        return "sha1:" + slot[1:21].hex()
    return slot[1 : 1 + slot[0]].decode("utf-8", "surrogateescape")


def _preallocated(typecode: str, count: int) -> array:
    """An array of `count` zeros whose memory is written now, so filling it later grows nothing."""
    return array(typecode, bytes(array(typecode).itemsize * count))


class RecordRing:
    """The last `capacity` records in arrival order (see the module docstring for the layout)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._at = _preallocated("d", capacity)
        self._ints = {name: _preallocated("i", capacity) for name in ("status", "headers_ms", "route_us")}
        self._labels = {name: _preallocated("I", capacity) for name in _LABELS}
        self._ids = bytearray(_ID_SLOT_BYTES * capacity)
        self._strings = _CountedStrings()
        self._next = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def distinct_labels(self) -> int:
        """How many distinct strings the held records name (bounded by the stack's names, not by traffic)."""
        return len(self._strings)

    def append(self, record: RequestRecord) -> None:
        slot, overwrites = self._next, self._size == self.capacity
        for name, column in self._labels.items():
            if overwrites:
                self._strings.release(column[slot])
            column[slot] = self._strings.hold(getattr(record, name))
        self._at[slot] = record.at
        self._ints["status"][slot] = record.status
        self._ints["headers_ms"][slot] = _NONE if record.ttft_s is None else round(record.ttft_s * 1000)
        self._ints["route_us"][slot] = _NONE if record.route_s is None else round(record.route_s * 1e6)
        self._ids[self._id_span(slot)] = _id_slot(record.request_id)
        self._next = (slot + 1) % self.capacity
        self._size = min(self._size + 1, self.capacity)

    def newest_since(self, since: float) -> Iterator[RequestRecord]:
        """The records that arrived at or after `since`, newest first (stops at the first older one)."""
        for slot in self._slots_newest_first():
            if self._at[slot] < since:
                return
            yield self._record(slot)

    def find(self, request_ids: Iterable[str]) -> list[RequestRecord]:
        """The held records of these ids, oldest first, each under the id it was asked for."""
        asked = {_id_slot(request_id): request_id for request_id in request_ids}
        found = []
        for back in range(self._size, 0, -1):
            slot = (self._next - back) % self.capacity
            request_id = asked.get(bytes(self._ids[self._id_span(slot)]))
            if request_id is not None:
                found.append(dataclasses.replace(self._record(slot), request_id=request_id))
        return found

    def _slots_newest_first(self) -> Iterator[int]:
        for back in range(1, self._size + 1):
            yield (self._next - back) % self.capacity

    @staticmethod
    def _id_span(slot: int) -> slice:
        return slice(slot * _ID_SLOT_BYTES, (slot + 1) * _ID_SLOT_BYTES)

    def _record(self, slot: int) -> RequestRecord:
        labels = {name: self._strings.value(column[slot]) for name, column in self._labels.items()}
        headers_ms, route_us = self._ints["headers_ms"][slot], self._ints["route_us"][slot]
        return RequestRecord(
            at=self._at[slot],
            status=self._ints["status"][slot],
            ttft_s=None if headers_ms == _NONE else headers_ms / 1000,
            route_s=None if route_us == _NONE else route_us / 1e6,
            request_id=_id_from_slot(bytes(self._ids[self._id_span(slot)])),
            **labels,  # type: ignore[arg-type]
        )
