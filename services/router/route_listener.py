"""The router replica's route agent: HAProxy's route calls as SPOE messages (SPOP over persistent, pipelined
connections) on a port of their own, without Serve.

Each NOTIFY frame carries one route call (`base.agent_wire`); the agent answers with an ACK whose set-var actions
are the decision, by calling the very function the HTTP app's route endpoint calls (`RouteAnswer`). A decision
that needs no wait (every policy without a capacity ledger) is made inside the frame's read, with no task; one
that awaits gets a task, and its ACK goes out when it is done (SPOP's async capability: ACKs in any order). The
app tells the agent's port at `ROUTE_LISTENER_PATH`; the frontend's router source reads it once per router replica
(`with_route_ports`). Why, and the protocol's limits: services/router/README.md.

Until its HELLO a peer may send one small frame (`HELLO_FRAME_BYTES`) and no NOTIFY, for `HELLO_TIMEOUT_S`; the
listener takes `MAX_CONNECTIONS` at once: a peer that is no HAProxy pins no memory and takes no capacity token.

A task is bounded by HAProxy's own wait for the answer (`deadline_s`, SPOE's processing timeout, less
`DEADLINE_MARGIN_S` for the frame's way there and the ACK's way back) and cancelled when its connection is lost:
HAProxy has then made the route call over HTTP instead, and an answer nobody reads must not hold what it took (a
capacity wait cancelled gives its grant back; `late_answers` counts them).

`observe_decision`, when given, is told the thread's CPU time of each frame answered within its read (a decision
that waits is a wait, not CPU, and is not told): the router's cost per decision, its transport included.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator, Mapping
from typing import Any

import httpx

from base.agent_wire import MESSAGE, Answer, answer_variables, request_from_arguments
from base.contracts import REASON_ROUTER_ERROR
from base.route_wire import RouteRefusal
from services.internal_credential import internal_headers
from services.router import spop
from services.router.route_request import DEADLINE_MARGIN_S
from services.router.spop import FrameError, FrameType, Status
from services.serve_internals import ReplicaEndpoint, list_replica_endpoints

logger = logging.getLogger(__name__)

# (status, answer) of a route call, from its headers (lower-case names) and body.
RouteAnswer = Callable[[Mapping[str, str], bytes], Awaitable[tuple[int, Answer]]]
# Told the CPU seconds of each decision made within its frame's read: the frame decoded, the decision, the ACK encoded.
DecisionObserver = Callable[[float], None]
ROUTE_LISTENER_PATH = "/internal/route-listener"
# The largest frame the agent takes: a forwarded body up to its maximum (`routing.body_buffer_bytes` is at most
# 64 MiB) and the route call's few headers.
MAX_FRAME_BYTES = 65 * 1024 * 1024
# Before its HELLO a peer is no HAProxy yet: a frame of a HELLO's size at most (HAProxy's is under 200 bytes), no
# NOTIFY, and the HELLO within HAProxy's own `timeout hello` or the connection is closed.
HELLO_FRAME_BYTES = 4096
HELLO_TIMEOUT_S = 5.0
# Connections at once: HAProxy keeps one per thread per agent server (a frontend per stack, a few threads each).
MAX_CONNECTIONS = 256
# Asking a router replica its agent's port: a local HTTP call; the next sync pass asks again on failure.
LOOKUP_TIMEOUT_S = 2.0
_FAILED = (500, RouteRefusal(reason=REASON_ROUTER_ERROR))


class _Resumed:
    """Drives a coroutine that has already run up to its first wait (`yielded`) to its end, inside a task."""

    def __init__(self, coroutine: Coroutine[Any, Any, Any], yielded: Any) -> None:
        self._coroutine = coroutine
        self._yielded = yielded

    def __await__(self) -> Generator[Any, Any, Any]:
        yielded = self._yielded
        while True:
            try:
                sent = yield yielded
            except BaseException as error:  # noqa: BLE001 - handed to the coroutine, as `await` would
                try:
                    yielded = self._coroutine.throw(error)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    yielded = self._coroutine.send(sent)
                except StopIteration as done:
                    return done.value


class _AgentConnection(asyncio.Protocol):
    """One connection from one HAProxy thread: the HELLO handshake, then NOTIFY frames until a DISCONNECT."""

    def __init__(self, listener: RouteListener) -> None:
        self._listener = listener
        self.pending: set[asyncio.Task[None]] = set()
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._max_frame = HELLO_FRAME_BYTES
        self._batch: list[bytes] | None = None
        self._hello_overdue: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        if len(self._listener.connections) >= MAX_CONNECTIONS:
            logger.warning("route agent: %d connections already, closing a new one", MAX_CONNECTIONS)
            transport.close()
            return
        self._listener.connections.add(self)
        self._hello_overdue = asyncio.get_running_loop().call_later(
            HELLO_TIMEOUT_S, self._disconnect, Status.TIMEOUT, "no HELLO in time"
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._listener.connections.discard(self)
        if self._hello_overdue is not None:
            self._hello_overdue.cancel()
        for task in self.pending:
            task.cancel()

    def data_received(self, data: bytes) -> None:
        # What this read answers goes out in one write: a burst of frames costs one send, not one per frame.
        self._batch = []
        try:
            self._read_frames(data)
        finally:
            self._flush()

    def _read_frames(self, data: bytes) -> None:
        self._buffer += data
        while len(self._buffer) >= 4 and self._transport is not None and not self._transport.is_closing():
            (length,) = spop.LENGTH.unpack_from(self._buffer)
            if length > self._max_frame:
                self._disconnect(Status.TOO_BIG, "frame too big")
                return
            if len(self._buffer) < 4 + length:
                return
            frame = bytes(self._buffer[4 : 4 + length])
            del self._buffer[: 4 + length]
            try:
                self._on_frame(spop.decode_frame(frame))
            except FrameError as error:
                logger.warning("route agent: disconnecting HAProxy: %s", error)
                self._disconnect(error.status, str(error))

    def _on_frame(self, frame: spop.Frame) -> None:
        if not frame.flags & spop.FLAG_FIN:
            raise FrameError(Status.FRAG_NOT_SUPPORTED, "fragmented frames are not supported")
        if frame.kind == FrameType.NOTIFY:
            if self._hello_overdue is not None:
                raise FrameError(Status.INVALID, "a NOTIFY before the HELLO")
            self._notify(frame)
        elif frame.kind == FrameType.HAPROXY_HELLO:
            self._hello(spop.decode_kv_list(frame.payload))
        elif frame.kind == FrameType.HAPROXY_DISCONNECT:
            self._disconnect(Status.NORMAL, "bye")
        else:
            raise FrameError(Status.INVALID, f"unexpected frame type {frame.kind}")

    def _hello(self, items: Mapping[str, spop.Value]) -> None:
        versions = items.get("supported-versions")
        if not isinstance(versions, bytes) or spop.VERSION not in versions.decode().replace(" ", "").split(","):
            raise FrameError(Status.BAD_VSN, "SPOP 2.0 is the version spoken here")
        offered = items.get("max-frame-size")
        if not isinstance(offered, int) or offered < 256:
            raise FrameError(Status.BAD_FRAME_SIZE, "no usable max-frame-size")
        self._max_frame = min(offered, MAX_FRAME_BYTES)
        if self._hello_overdue is not None:
            self._hello_overdue.cancel()
            self._hello_overdue = None
        reply = {"version": spop.VERSION, "max-frame-size": self._max_frame, "capabilities": spop.CAPABILITIES}
        self._write(spop.encode_frame(FrameType.AGENT_HELLO, 0, 0, spop.encode_kv_list(reply)))
        if items.get("healthcheck") is True:
            self._close()

    def _notify(self, frame: spop.Frame) -> None:
        observe = self._listener.observe_decision
        if observe is None:
            self._notify_one(frame)
            return
        started = time.thread_time()
        self._notify_one(frame)
        observe(time.thread_time() - started)

    def _notify_one(self, frame: spop.Frame) -> None:
        arguments = spop.decode_messages(frame.payload).get(MESSAGE)
        if arguments is None:
            self._ack(frame, b"")
            return
        received = asyncio.get_running_loop().time()
        headers, body = request_from_arguments(arguments, self._listener.session_header)
        coroutine = self._listener.answer(headers, body)
        try:
            yielded = coroutine.send(None)  # type: ignore[attr-defined]
        except StopIteration as done:
            self._ack_answer(frame, done.value)
            return
        except Exception:
            logger.exception("route call failed")
            self._ack_answer(frame, _FAILED)
            return
        resumed = _Resumed(coroutine, yielded)  # type: ignore[arg-type]
        task = asyncio.get_running_loop().create_task(self._finish(frame, resumed, received))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _finish(self, frame: spop.Frame, pending: _Resumed, received: float) -> None:
        deadline_s = self._listener.deadline_s
        bound = asyncio.timeout_at(None if deadline_s is None else received + deadline_s - DEADLINE_MARGIN_S)
        try:
            async with bound:
                answered = await pending
        except TimeoutError:
            if not bound.expired():
                raise
            self._listener.late_answers += 1
            logger.warning("route call answered by HTTP instead: its agent decision outlasted HAProxy's wait")
            return
        except Exception:
            logger.exception("route call failed")
            answered = _FAILED
        self._ack_answer(frame, answered)

    def _ack_answer(self, frame: spop.Frame, answered: tuple[int, Answer]) -> None:
        self._ack(frame, spop.set_var_actions(answer_variables(*answered)))

    def _ack(self, frame: spop.Frame, actions: bytes) -> None:
        self._write(spop.encode_frame(FrameType.ACK, frame.stream_id, frame.frame_id, actions))

    def _disconnect(self, status: Status, message: str) -> None:
        payload = spop.encode_kv_list({"status-code": int(status), "message": message})
        self._write(spop.encode_frame(FrameType.AGENT_DISCONNECT, 0, 0, payload))
        self._close()

    def _write(self, data: bytes) -> None:
        if self._batch is not None:
            self._batch.append(data)
        elif self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def _flush(self) -> None:
        batch, self._batch = self._batch, None
        if batch:
            self._write(b"".join(batch))

    def _close(self) -> None:
        self._flush()
        if self._transport is not None:
            self._transport.close()


class RouteListener:
    """Serves route calls as an SPOE agent on `host`:`port` (0: a free one) until closed; `deadline_s`: how long
    HAProxy waits for an answer (None: unbounded)."""

    def __init__(
        self,
        answer: RouteAnswer,
        session_header: str,
        deadline_s: float | None = None,
        observe_decision: DecisionObserver | None = None,
    ) -> None:
        self.answer = answer
        self.observe_decision = observe_decision
        self.session_header = session_header
        self.deadline_s = deadline_s
        self.late_answers = 0
        self.connections: set[_AgentConnection] = set()
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int = 0) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _AgentConnection(self), host, port)
        return self._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.close()


async def with_route_ports(
    endpoints: list[ReplicaEndpoint], route_prefix: str, known: dict[str, int], headers: dict[str, str]
) -> list[ReplicaEndpoint]:
    """Router endpoints with the port of their route listener, asked once per router replica (`known` caches it by
    replica id) with `headers` (the internal credential). A router that does not answer keeps its Serve port for
    route calls until it does."""
    for stale in set(known) - {e.replica_id for e in endpoints}:
        del known[stale]
    unknown = [e for e in endpoints if e.replica_id not in known]
    if unknown:
        async with httpx.AsyncClient(timeout=LOOKUP_TIMEOUT_S, headers=headers) as client:
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
        endpoints = await list_replica_endpoints(router_app)
        return await with_route_ports(endpoints, route_prefix, known, internal_headers())

    return routers
