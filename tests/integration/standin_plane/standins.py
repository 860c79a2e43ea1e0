"""Stand-in replicas and fault-injecting routers for the HAProxy data-plane tests (the plane around them: plane.py).

These stand-ins exist only for data-plane fault injection (a real router never answers garbage); the
end-to-end tests with real vLLM replicas and the real router service are in ../direct_path/.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn

from base.contracts import (
    DIRECT_PATH,
    HEALTH_PATH,
    MEMBERSHIP_PATH,
    REASON_NO_REPLICA,
    REPLICA_HEADER,
    REQUEST_ID_HEADER,
    ROUTE_PATH,
    SERVE_PATH_HEADER,
    SERVE_REASON_HEADER,
)
from base.route_wire import Membership, RouteRefusal, RouteReply
from services.serve_internals import ReplicaEndpoint
from tests.support.ports import free_port
from tests.support.sse import data_payloads, stream_lines

APP = "llm"
LOOPBACK = "127.0.0.1"
ROUTE_TIMEOUT_S = 1.0
BODY_BUFFER_BYTES = 16384
CHAT_PATH = "/v1/chat/completions"
# The fail-open plane's router deployment sits under a route prefix.
OPEN_ROUTER_PREFIX = "/open"
# The plane's internal credential (a cluster's comes from Ray's KV): what HAProxy sends past itself.
PLANE_CREDENTIAL = "stand-in-plane-credential"


class LoopThread:
    """One event loop in a background thread for every stand-in server and the syncers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="stand-ins", daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 10.0) -> Any:
        return self.submit(coro).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


async def read_body(receive: Callable[[], Coroutine[Any, Any, dict[str, Any]]]) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


async def respond(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers or []})
    await send({"type": "http.response.body", "body": body})


@dataclass
class Recorded:
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k == name]
        assert len(values) <= 1, f"{name} sent {len(values)} times"
        return values[0] if values else None


class StandIn:
    """A uvicorn server on a free loopback port, started and stopped on the loop thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.port = free_port()
        self.server: uvicorn.Server | None = None
        self.task: asyncio.Task[None] | None = None

    @property
    def endpoint(self) -> ReplicaEndpoint:
        return ReplicaEndpoint(replica_id=self.name, deployment="stand-in", host=LOOPBACK, port=self.port)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    async def start(self) -> None:
        config = uvicorn.Config(
            self, host=LOOPBACK, port=self.port, log_level="warning", lifespan="off", timeout_graceful_shutdown=1
        )
        self.server = uvicorn.Server(config)
        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self.task.done():
                self.task.result()
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self.server is not None and self.task is not None:
            self.server.should_exit = True
            await self.task
        self.server = self.task = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise NotImplementedError


class ReplicaStandIn(StandIn):
    """/-/healthz (503 when unhealthy), GET /v1/models, and any POST answered as a short SSE stream whose first
    event tells which replica served and which headers and how many body bytes it received."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.healthy = True
        self.requests: list[Recorded] = []

    def posts(self) -> int:
        return sum(1 for r in self.requests if r.method != "GET")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        if scope["path"] == HEALTH_PATH:
            await respond(send, 200 if self.healthy else 503, b"ok" if self.healthy else b"draining")
            return
        headers = [(k.decode().lower(), v.decode()) for k, v in scope["headers"]]
        request = Recorded(scope["method"], scope["path"], headers, body)
        self.requests.append(request)
        reply_headers = [(REPLICA_HEADER.encode(), self.name.encode())]
        if (request_id := request.header(REQUEST_ID_HEADER)) is not None:
            reply_headers.append((REQUEST_ID_HEADER.encode(), request_id.encode()))
        if scope["method"] == "GET":
            models = {"object": "list", "data": [{"id": "stand-in", "object": "model", "owned_by": self.name}]}
            await respond(
                send, 200, json.dumps(models).encode(), [(b"content-type", b"application/json")] + reply_headers
            )
            return
        try:
            params = json.loads(body)
        except ValueError:
            params = {}
        params = params if isinstance(params, dict) else {}
        if "status" in params:
            await respond(send, int(params["status"]), b"stand-in error", reply_headers)
            return
        await asyncio.sleep(float(params.get("headers_delay_s", 0)))
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")] + reply_headers,
            }
        )
        first = {"replica": self.name, "headers": headers, "body_len": len(body)}
        await send({"type": "http.response.body", "body": sse(first), "more_body": True})
        for i in range(int(params.get("events", 2))):
            await asyncio.sleep(float(params.get("delay_s", 0)))
            await send({"type": "http.response.body", "body": sse({"i": i}), "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


class TinyReplica:
    """A stand-in replica on a raw asyncio server, for tests that need many (no uvicorn per replica): answers
    `/-/healthz`, and any other request with 200 and `x-serve-replica`, or, in `close_without_answer` mode, closes
    the connection before answering."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.port = free_port()
        self.close_without_answer = False
        self.server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()

    @property
    def endpoint(self) -> ReplicaEndpoint:
        return ReplicaEndpoint(replica_id=self.name, deployment="stand-in", host=LOOPBACK, port=self.port)

    async def start(self) -> None:
        for _ in range(20):  # another stand-in may have taken the port picked at construction
            try:
                self.server = await asyncio.start_server(self._serve, LOOPBACK, self.port)
                return
            except OSError:
                self.port = free_port()
        raise RuntimeError(f"no free port for stand-in {self.name}")

    async def stop(self) -> None:
        """Like a killed process: the port refuses, and every open connection (idle keep-alive too) is closed."""
        if self.server is not None:
            self.server.close()
            for writer in list(self._connections):
                writer.close()
            await self.server.wait_closed()
        self.server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                if self.close_without_answer and not head.split(b" ")[1].startswith(HEALTH_PATH.encode()):
                    break
                body = self.name.encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s: %s\r\n\r\n%s"
                    % (len(body), REPLICA_HEADER.encode(), body, body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._connections.discard(writer)
            writer.close()


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


@dataclass
class RouterBehavior:
    """What every stand-in router answers to `POST /internal/route`; shared, switched by the tests."""

    mode: str = "choose"
    replica_ids: list[str] = field(default_factory=list)
    # When set, "choose" answers exactly this ranking (primary, then fallbacks) instead of cycling.
    ranked: list[str] | None = None
    capacity_token: str | None = None
    # Prefill/decode: the (prefill replica id, prefill URL) every "choose" answer names.
    prefill: tuple[str, str] | None = None
    # A tracing router's: the traceparent every "choose" answer names.
    traceparent: str | None = None
    cursor: int = 0
    decisions: dict[str, str] = field(default_factory=dict)  # request id -> chosen replica id
    calls: list[tuple[str, Recorded]] = field(default_factory=list)  # (router name, request)
    memberships: list[tuple[str, Membership]] = field(default_factory=list)  # (router name, publication)
    release: asyncio.Event | None = None  # stalled calls wait on it

    def choose(self) -> str:
        self.cursor += 1
        return self.replica_ids[self.cursor % len(self.replica_ids)]


class RouterStandIn(StandIn):
    def __init__(self, name: str, behavior: RouterBehavior) -> None:
        super().__init__(name)
        self.behavior = behavior

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        if scope["path"] == HEALTH_PATH:
            await respond(send, 200, b"ok")
            return
        if scope["path"] in (MEMBERSHIP_PATH, OPEN_ROUTER_PREFIX + MEMBERSHIP_PATH):
            self.behavior.memberships.append((self.name, Membership.model_validate_json(body)))
            await respond(send, 204, b"")
            return
        if scope["path"] not in (ROUTE_PATH, OPEN_ROUTER_PREFIX + ROUTE_PATH):
            await respond(send, 404, b"not found")
            return
        b = self.behavior
        request = Recorded(
            scope["method"], scope["path"], [(k.decode(), v.decode()) for k, v in scope["headers"]], body
        )
        b.calls.append((self.name, request))
        json_type = [(b"content-type", b"application/json")]
        mode = b.mode
        if mode == "stall":
            assert b.release is not None
            await b.release.wait()
            return await respond(send, 200, RouteReply(replica_id=b.replica_ids[0]).model_dump_json().encode())
        if mode == "choose":
            ranked = list(b.ranked) if b.ranked is not None else [b.choose()]
            b.decisions[request.header(REQUEST_ID_HEADER) or ""] = ranked[0]
            prefill_id, prefill_url = b.prefill or (None, None)
            reply = RouteReply(
                replica_id=ranked[0],
                fallbacks=ranked[1:],
                capacity_token=b.capacity_token,
                prefill_replica_id=prefill_id,
                prefill_url=prefill_url,
                traceparent=b.traceparent,
            )
            return await respond(send, 200, reply.model_dump_json().encode(), json_type)
        if mode == "http_500":
            return await respond(send, 500, b"Internal Server Error")
        if mode == "garbage":
            return await respond(send, 200, b"<html>this is not json</html>")
        if mode == "missing_id":
            return await respond(send, 200, b'{"server": "replica1", "fallbacks": []}', json_type)
        if mode == "unknown":
            return await respond(send, 200, RouteReply(replica_id="no-such-replica").model_dump_json().encode())
        if mode == "no_replica":
            return await respond(send, 503, RouteRefusal(reason=REASON_NO_REPLICA).model_dump_json().encode())
        if mode == "bad_reason":
            return await respond(send, 503, b'{"reason": "Not A Reason!"}', json_type)
        raise AssertionError(f"unknown router mode {mode}")


def first_event(response: httpx.Response) -> dict[str, Any]:
    payloads = data_payloads(response.text)
    assert payloads and payloads[-1] == "[DONE]", response.text[-200:]
    return json.loads(payloads[0])


def assert_pinned(response: httpx.Response, behavior: RouterBehavior) -> str:
    """The replica the router chose served the response, on the direct path; returns its id."""
    assert response.status_code == 200, (response.status_code, response.headers, response.text[:300])
    request_id = response.headers[REQUEST_ID_HEADER]
    served = response.headers[REPLICA_HEADER]
    assert served == behavior.decisions[request_id], "served by a replica the router did not choose"
    assert first_event(response)["replica"] == served
    assert response.headers[SERVE_PATH_HEADER] == DIRECT_PATH
    return served


def assert_fail_closed(response: httpx.Response, reason: str) -> None:
    assert response.status_code == 503, response.text
    assert response.headers[SERVE_REASON_HEADER] == reason
    assert response.headers["content-type"] == "application/json"
    assert response.headers[REQUEST_ID_HEADER]
    assert REPLICA_HEADER not in response.headers
    error = response.json()["error"]
    assert error["type"] == "service_unavailable" and error["code"] == 503 and reason in error["message"]


def stream_one(url: str, payload: dict[str, Any]) -> tuple[httpx.Headers, list[str]]:
    with httpx.Client(timeout=30) as client, client.stream("POST", url + CHAT_PATH, json=payload) as response:
        assert response.status_code == 200, response.read()
        return response.headers, [line[6:] for line in stream_lines(response) if line.startswith("data: ")]


def rearm_stall(loop: LoopThread, behavior: RouterBehavior) -> None:
    """Let every stalled route call answer, and give the next stall a fresh event (created on the loop)."""
    if behavior.release is not None:
        loop.loop.call_soon_threadsafe(behavior.release.set)
    loop.run(_new_release_event(behavior))


async def _new_release_event(behavior: RouterBehavior) -> None:
    await asyncio.sleep(0)  # the set() above runs first
    behavior.release = asyncio.Event()
