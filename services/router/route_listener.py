"""The router replica's route listener: HAProxy's route calls answered on a port of their own, without Serve.

A bare asyncio protocol (one HTTP/1.0 request per connection, then close) calls the very function the HTTP app's
route endpoint calls, saving Serve's ~0.6 ms of CPU per call. The app tells the listener's port at
`ROUTE_LISTENER_PATH`; the frontend's router source reads it once per router replica (`with_route_ports`).
Why, and the protocol's limits: services/router/README.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

import httpx

from base.contracts import ROUTE_PATH
from services.serve_internals import ReplicaEndpoint, list_replica_endpoints

logger = logging.getLogger(__name__)

# (status, JSON body) of a route call, from its headers (lower-case names) and body.
RouteAnswer = Callable[[Mapping[str, str], bytes], Awaitable[tuple[int, str]]]
ROUTE_LISTENER_PATH = "/internal/route-listener"
# Request line and headers: the Lua action sends a handful of short headers.
MAX_HEAD_BYTES = 64 * 1024
# The largest body a frontend forwards to its router (`routing.body_buffer_bytes` is at most 64 MiB).
MAX_BODY_BYTES = 64 * 1024 * 1024
# Asking a router replica its listener's port: a local HTTP call; the next sync pass asks again on failure.
LOOKUP_TIMEOUT_S = 2.0
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error", 503: "Service Unavailable"}


def _reply(status: int, body: str) -> bytes:
    payload = body.encode()
    head = (
        f"HTTP/1.0 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + payload


class _RouteCall(asyncio.Protocol):
    """One connection: read the request whole, answer it, close."""

    def __init__(self, answer: RouteAnswer, running: set[asyncio.Task[None]]) -> None:
        self._answer = answer
        self._running = running
        self._buffer = bytearray()
        self._body_start = -1
        self._length = 0
        self._headers: dict[str, str] = {}
        self._dispatched = False
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._body_start < 0:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > MAX_HEAD_BYTES:
                    self._finish(400, '{"reason": "request head too large"}')
                return
            self._body_start = end + 4
            if not self._parse_head(bytes(self._buffer[:end])):
                return
        if not self._dispatched and len(self._buffer) - self._body_start >= self._length:
            self._dispatched = True
            body = bytes(self._buffer[self._body_start : self._body_start + self._length])
            task = asyncio.get_running_loop().create_task(self._respond(body))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    def _parse_head(self, head: bytes) -> bool:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            self._finish(400, '{"reason": "malformed request line"}')
            return False
        self._headers = {
            name.strip().lower(): value.strip() for name, _, value in (h.partition(":") for h in lines[1:])
        }
        try:
            self._length = int(self._headers.get("content-length", "0"))
        except ValueError:
            self._length = -1
        if not 0 <= self._length <= MAX_BODY_BYTES:
            self._finish(400, '{"reason": "bad content-length"}')
            return False
        if parts[0] != "POST" or not parts[1].endswith(ROUTE_PATH):
            self._finish(404, '{"reason": "only route calls are answered here"}')
            return False
        return True

    async def _respond(self, body: bytes) -> None:
        try:
            status, payload = await self._answer(self._headers, body)
        except Exception:
            logger.exception("route call failed")
            status, payload = 500, '{"reason": "router_error"}'
        self._finish(status, payload)

    def _finish(self, status: int, payload: str) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(_reply(status, payload))
            self._transport.close()


class RouteListener:
    """Serves route calls on `host`:`port` (0: a free one) until closed."""

    def __init__(self, answer: RouteAnswer) -> None:
        self._answer = answer
        self._running: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int = 0) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _RouteCall(self._answer, self._running), host, port)
        return self._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.close()


async def with_route_ports(
    endpoints: list[ReplicaEndpoint], route_prefix: str, known: dict[str, int]
) -> list[ReplicaEndpoint]:
    """Router endpoints with the port of their route listener, asked once per router replica (`known` caches it by
    replica id). A router that does not answer keeps its Serve port for route calls until it does."""
    for stale in set(known) - {e.replica_id for e in endpoints}:
        del known[stale]
    unknown = [e for e in endpoints if e.replica_id not in known]
    if unknown:
        async with httpx.AsyncClient(timeout=LOOKUP_TIMEOUT_S) as client:
            for endpoint in unknown:
                try:
                    response = await client.get(f"{endpoint.url}{route_prefix}{ROUTE_LISTENER_PATH}")
                    response.raise_for_status()
                    known[endpoint.replica_id] = int(response.json()["port"])
                except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
                    logger.debug("router %s has no route listener port yet: %r", endpoint.replica_id, error)
    return [e.model_copy(update={"route_port": known[e.replica_id]}) if e.replica_id in known else e for e in endpoints]


def router_source(router_app: str, route_prefix: str) -> Callable[[], Awaitable[list[ReplicaEndpoint]]]:
    """The syncer's source of a router app's endpoints, each with its route listener's port once known."""
    known: dict[str, int] = {}

    async def routers() -> list[ReplicaEndpoint]:
        return await with_route_ports(await list_replica_endpoints(router_app), route_prefix, known)

    return routers
