"""The router's route listener answers route calls like its HTTP app, and HAProxy's router servers point at it
while their health checks probe Serve's port."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from pathlib import Path

from infra.haproxy.config import ROUTER_BACKEND
from services.router.route_listener import MAX_HEAD_BYTES, RouteListener
from tests.support.syncer_fakes import FakeRuntime, endpoint, make_syncer

LOOPBACK = "127.0.0.1"


async def _echo(headers: Mapping[str, str], body: bytes) -> tuple[int, str]:
    return 200, json.dumps({"headers": dict(headers), "body": body.decode()})


async def _exchange(port: int, *pieces: bytes) -> bytes:
    """Send the request in pieces (as a slow network would) and read until the listener closes."""
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    for piece in pieces:
        writer.write(piece)
        await writer.drain()
        await asyncio.sleep(0.01)
    reply = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return reply


def _call(*pieces: bytes) -> tuple[int, bytes]:
    async def run() -> bytes:
        listener = RouteListener(_echo)
        port = await listener.start(LOOPBACK)
        try:
            return await _exchange(port, *pieces)
        finally:
            listener.close()

    reply = asyncio.run(run())
    head, _, body = reply.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower()
    return int(head.split(b" ", 2)[1]), body


def test_a_route_call_gets_the_answer_with_lower_case_headers_and_the_whole_body() -> None:
    request = b"POST /app-router/internal/route HTTP/1.0\r\nX-Session-Id: s1\r\nContent-Length: 12\r\n\r\n"
    status, body = _call(request, b'{"model":', b" 1}")
    assert status == 200
    answer = json.loads(body)
    assert answer["headers"]["x-session-id"] == "s1" and answer["body"] == '{"model": 1}'


def test_anything_but_a_route_call_is_refused_with_a_status() -> None:
    assert _call(b"GET /app-router/internal/route HTTP/1.0\r\n\r\n")[0] == 404
    assert _call(b"POST /metrics HTTP/1.0\r\nContent-Length: 0\r\n\r\n")[0] == 404
    assert _call(b"POST /internal/route HTTP/1.0\r\nContent-Length: x\r\n\r\n")[0] == 400
    assert _call(b"garbage\r\n\r\n")[0] == 400
    assert _call(b"POST /internal/route HTTP/1.0\r\nX-Big: " + b"a" * MAX_HEAD_BYTES)[0] == 400


def test_a_failing_answer_is_a_500_not_a_dropped_connection() -> None:
    async def failing(headers: Mapping[str, str], body: bytes) -> tuple[int, str]:
        raise RuntimeError("policy bug")

    async def run() -> bytes:
        listener = RouteListener(failing)
        port = await listener.start(LOOPBACK)
        try:
            return await _exchange(port, b"POST /internal/route HTTP/1.0\r\nContent-Length: 0\r\n\r\n")
        finally:
            listener.close()

    assert asyncio.run(run()).startswith(b"HTTP/1.0 500")


def test_a_router_server_points_at_its_listener_and_is_checked_on_serves_port(tmp_path: Path) -> None:
    runtime = FakeRuntime()
    routers = [endpoint("r", 2001).model_copy(update={"route_port": 3001})]
    syncer = make_syncer(tmp_path, runtime, [endpoint("a", 1001)], routers, [0.0])
    asyncio.run(syncer.sync_once())
    server = runtime.servers[(ROUTER_BACKEND, "r")]
    assert server["addr"] == "127.0.0.1:3001" and server["options"][-2:] == ["port", "2001"]
    # The listener's port learnt after the server was added: the server moves to it, checks stay on Serve's port.
    routers[:] = [endpoint("q", 2002)]
    asyncio.run(syncer.sync_once())
    routers[:] = [endpoint("q", 2002).model_copy(update={"route_port": 3002})]
    assert asyncio.run(syncer.sync_once()).moved == ["q"]
    moved = runtime.servers[(ROUTER_BACKEND, "q")]
    assert moved["addr"] == "127.0.0.1:3002" and moved["check_port"] == 2002
    # A fresh syncer (e.g. the frontend restarted) adopts a router server at its listener instead of replacing it.
    again = make_syncer(tmp_path, runtime, [endpoint("a", 1001)], routers, [1.0])
    assert not asyncio.run(again.sync_once()).changed and set(again.apps[0].routers.live) == {"q"}
