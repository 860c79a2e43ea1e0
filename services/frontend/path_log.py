"""The frontend's request log: HAProxy sends one datagram per finished request (`infra.haproxy.canary.log_format`)
to a unix socket the frontend replica reads; each becomes a `RequestRecord`, kept for the canary guard's window and
for `sluice check`. Anything else on the socket is ignored (services/frontend/README.md, the canary).

Records arrive on the frontend's background loop and are read from Serve's replica thread too (`ingress`, `shift`,
`requests`): every access holds one lock, and a reader gets a list of its own, never an iterator over the store
(a deque iterated while another thread appends raised). A window read stops at the first record older than the
window: records are kept in arrival order, so it reads the window, not the whole log. They are kept in a
`RecordRing`, columns allocated when the frontend starts (`MAX_RECORDS` x `SLOT_BYTES`, ~17 MB), so the log's
memory does not grow with the traffic.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from infra.haproxy.canary import LOG_TAG
from services.frontend.canary_guard import RequestRecord
from services.frontend.record_ring import INT_COLUMN_MAX, RecordRing

logger = logging.getLogger(__name__)
# Records kept at most (the window is also bounded by age, `records_since`).
MAX_RECORDS = 200_000
_UNSET = "-"


def parse_record(line: str, at: float) -> RequestRecord | None:
    """A record from one rendered log line, or None when the line is not one (or names no path)."""
    fields = line.strip().split(" ", 11)
    if len(fields) != 12 or fields[0] != LOG_TAG or fields[2] == _UNSET:
        return None
    _, app, path, status, headers_ms, _total_ms, termination, server, served, route_us, reason, request_id = fields
    try:
        status_code, ttft_ms = int(status), int(headers_ms)
        route_micros = None if route_us == _UNSET else int(route_us)
    except ValueError:
        return None
    if not all(-1 <= value <= INT_COLUMN_MAX for value in (status_code, ttft_ms, route_micros or 0)):
        return None
    return RequestRecord(
        at=at,
        app=app,
        path=path,
        status=status_code,
        ttft_s=ttft_ms / 1000 if ttft_ms >= 0 else None,
        termination=termination,
        server=server,
        served_replica=None if served == _UNSET else served,
        request_id=request_id,
        route_s=None if route_micros is None else route_micros / 1e6,
        reason=None if reason == _UNSET else reason,
    )


class PathLog(asyncio.DatagramProtocol):
    """The records of the last `MAX_RECORDS` finished requests, in arrival order."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, capacity: int = MAX_RECORDS) -> None:
        self._records = RecordRing(capacity)
        self.clock = clock
        self._lock = threading.Lock()

    def datagram_received(self, data: bytes, addr: object) -> None:
        record = parse_record(data.decode("utf-8", "replace"), self.clock())
        if record is not None:
            self.add(record)

    def add(self, record: RequestRecord) -> None:
        with self._lock:
            self._records.append(record)

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def records_since(self, since: float) -> list[RequestRecord]:
        """The records at or after `since`, newest first."""
        with self._lock:
            return list(self._records.newest_since(since))

    def find(self, request_ids: set[str]) -> list[RequestRecord]:
        """The records of these request ids, oldest first."""
        with self._lock:
            return self._records.find(request_ids)

    async def listen(self, path: Path) -> asyncio.DatagramTransport:
        """Bind the unix datagram socket HAProxy logs to (replacing a stale one)."""
        path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
        sock.bind(str(path))
        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(lambda: self, sock=sock)
        return transport  # type: ignore[return-value]
