"""The router's route agent speaks SPOP as HAProxy does: the HELLO handshake, NOTIFY frames answered by ACKs whose
set-var actions are the route call's answer (pipelined, in any order), errors answered by AGENT-DISCONNECT; HAProxy's
agent servers point at it while their health checks probe Serve's port."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from pathlib import Path

import pytest

from base.agent_wire import ANSWER_VARS, BODY_ARG, MESSAGE, REPLY_VARS, Answer, answer_variables
from base.contracts import FRONTEND_HEADER, REASON_ROUTER_ERROR, REQUEST_ID_HEADER
from base.route_wire import RouteRefusal, RouteReply
from infra.haproxy.config import ROUTER_BACKEND
from infra.haproxy.spoe import AGENT_BACKEND
from routers.capacity_ledger import CapacityLedger
from routers.core import RouteRequest
from services.router import route_listener, spop
from services.router.http_app import route_reply
from services.router.route_listener import DEADLINE_MARGIN_S, RouteListener
from services.router.spop import FrameType, Status
from tests.support.capacity import queue, views
from tests.support.syncer_fakes import FakeRuntime, endpoint, make_syncer

LOOPBACK = "127.0.0.1"
SESSION = "x-session-id"
HELLO = {"supported-versions": "2.0", "max-frame-size": 16380, "capabilities": "pipelining,async", "engine-id": "e1"}


async def _answer(headers: Mapping[str, str], body: bytes) -> tuple[int, Answer]:
    session = headers.get(SESSION, "")
    if session == "refuse":
        return 503, RouteRefusal(reason="no_replica")
    if session == "fail":
        raise RuntimeError("policy bug")
    if session == "slow":
        await asyncio.sleep(0.05)
    fallbacks = [headers.get(REQUEST_ID_HEADER, "none"), headers.get(FRONTEND_HEADER, "none")]
    return 200, RouteReply(replica_id=f"r-{session}-{len(body)}", fallbacks=fallbacks, capacity_token="t1")


def _notify(stream_id: int, frame_id: int, arguments: dict[str, spop.Value]) -> bytes:
    payload = spop.encode_string(MESSAGE) + bytes((len(arguments),)) + spop.encode_kv_list(arguments)
    return spop.encode_frame(FrameType.NOTIFY, stream_id, frame_id, payload)


def _hello(items: dict[str, spop.Value] = HELLO) -> bytes:
    return spop.encode_frame(FrameType.HAPROXY_HELLO, 0, 0, spop.encode_kv_list(items))


def _variables(payload: bytes | memoryview) -> dict[str, spop.Value]:
    """An ACK's set-var actions as name -> value (all in the transaction's scope)."""
    variables: dict[str, spop.Value] = {}
    offset = 0
    while offset < len(payload):
        assert (payload[offset], payload[offset + 1], payload[offset + 2]) == (spop.ACTION_SET_VAR, 3, 2)
        name, offset = spop.decode_bytes(payload, offset + 3)
        variables[name.decode()], offset = spop.decode_value(payload, offset)
    return variables


async def _read_frames(reader: asyncio.StreamReader, count: int) -> list[spop.Frame]:
    frames = []
    for _ in range(count):
        (length,) = spop.LENGTH.unpack(await asyncio.wait_for(reader.readexactly(4), 5))
        frames.append(spop.decode_frame(await reader.readexactly(length)))
    return frames


def _exchange(*writes: bytes, replies: int, closes: bool = False) -> list[spop.Frame]:
    async def run() -> list[spop.Frame]:
        listener = RouteListener(_answer, SESSION)
        port = await listener.start(LOOPBACK)
        reader, writer = await asyncio.open_connection(LOOPBACK, port)
        try:
            for data in writes:
                writer.write(data)
            await writer.drain()
            frames = await _read_frames(reader, replies)
            if closes:
                assert await asyncio.wait_for(reader.read(), 5) == b""
            return frames
        finally:
            writer.close()
            listener.close()

    return asyncio.run(run())


@pytest.mark.parametrize("value", [0, 1, 239, 240, 2287, 2288, 65535, 2**32 - 1, 2**32, 2**63 - 1])
def test_varints_round_trip_at_every_length_boundary(value: int) -> None:
    encoded = spop.encode_varint(value)
    assert spop.decode_varint(encoded + b"\xff", 0) == (value, len(encoded))
    assert (len(encoded) == 1) == (value < 240)


def test_typed_values_round_trip_and_truncated_data_is_an_invalid_frame() -> None:
    for value, decoded in [(None, None), (True, True), (False, False), (7, 7), (2**40, 2**40), ("é", "é".encode())]:
        assert spop.decode_value(spop.encode_value(value), 0)[0] == decoded
    with pytest.raises(spop.FrameError) as error:
        spop.decode_value(spop.encode_value("long string")[:-2], 0)
    assert error.value.status == Status.INVALID


def test_the_hello_handshake_agrees_on_version_frame_size_and_pipelining() -> None:
    [reply] = _exchange(_hello(), replies=1)
    items = spop.decode_kv_list(reply.payload)
    assert reply.kind == FrameType.AGENT_HELLO and reply.flags & spop.FLAG_FIN
    assert items == {"version": b"2.0", "max-frame-size": 16380, "capabilities": b"pipelining,async"}


def test_a_health_check_hello_is_answered_then_closed() -> None:
    [reply] = _exchange(_hello({**HELLO, "healthcheck": True}), replies=1, closes=True)
    assert reply.kind == FrameType.AGENT_HELLO


def test_each_notify_is_acked_with_its_answer_as_variables_in_any_order() -> None:
    frames = [
        _notify(11, 1, {SESSION: b"slow", REQUEST_ID_HEADER: b"req-1", FRONTEND_HEADER: b"fe", BODY_ARG: b"abc"}),
        _notify(12, 1, {SESSION: b"quick", REQUEST_ID_HEADER: b"req-2"}),
        _notify(13, 4, {SESSION: b"refuse"}),
        _notify(14, 1, {SESSION: b"fail"}),
    ]
    replies = _exchange(_hello(), b"".join(frames), replies=5)
    acks = {frame.stream_id: frame for frame in replies[1:]}
    # The slow decision's ACK comes last: the others did not wait behind it.
    assert replies[-1].stream_id == 11 and all(frame.kind == FrameType.ACK for frame in replies[1:])
    assert acks[13].frame_id == 4
    assert _variables(acks[11].payload) == {
        "status": 200,
        "replica_id": b"r-slow-3",
        "fallbacks": b"req-1,fe",
        "capacity_token": b"t1",
    }
    assert _variables(acks[12].payload)["fallbacks"] == b"req-2,none"
    assert _variables(acks[13].payload) == {"status": 503, "reason": b"no_replica"}
    assert _variables(acks[14].payload) == {"status": 500, "reason": REASON_ROUTER_ERROR.encode()}


# HAProxy's wait for the agent in these tests (SPOE's processing timeout).
AGENT_DEADLINE_S = 0.4


def _capacity_wait_past_haproxys_wait(
    close_at_once: bool, deadline_s: float | None = AGENT_DEADLINE_S
) -> tuple[dict, list[spop.Frame], RouteListener]:
    """A capacity_queue agent on one replica of capacity 1 whose slot another request holds: a NOTIFY waits in the
    ledger; twice HAProxy's wait later (its connection closed at once, or kept) the slot is freed. The ledger's
    figures then, the frames the agent sent after its HELLO, and the listener."""

    async def run() -> tuple[dict, list[spop.Frame], RouteListener]:
        ledger = CapacityLedger(seed=0)
        ledger.set_replicas({"a": 1})
        policy = queue(ledger, max_wait_s=30)
        replicas = views({"a": 1})
        held = await ledger.acquire(["a"], "earlier")
        assert held is not None

        async def answer(headers: Mapping[str, str], body: bytes) -> tuple[int, Answer]:
            request = RouteRequest(request_id=headers[REQUEST_ID_HEADER])
            return 200, route_reply(await policy.decide(replicas, request))

        listener = RouteListener(answer, SESSION, deadline_s=deadline_s)
        port = await listener.start(LOOPBACK)
        reader, writer = await asyncio.open_connection(LOOPBACK, port)
        writer.write(_hello() + _notify(1, 1, {REQUEST_ID_HEADER: b"late"}))
        await writer.drain()
        await _read_frames(reader, 1)
        if close_at_once:
            writer.close()
        await asyncio.sleep(2 * AGENT_DEADLINE_S)
        ledger.release(held.token_id)
        await asyncio.sleep(0.05)  # what the freed slot wakes runs
        acks = []
        if not close_at_once:
            with contextlib.suppress(TimeoutError):
                acks = await asyncio.wait_for(_read_frames(reader, 1), 0.3)
            writer.close()
        listener.close()
        return ledger.snapshot(), acks, listener

    return asyncio.run(run())


def test_a_capacity_wait_that_outlasts_haproxys_wait_is_cancelled_and_holds_no_token() -> None:
    """HAProxy gave up on the agent and made the route call over HTTP: the agent's decision, still waiting in the
    ledger, is cancelled at that deadline instead of taking the next free slot for a request nobody sends."""
    ledger, acks, listener = _capacity_wait_past_haproxys_wait(close_at_once=False)
    assert acks == [] and listener.late_answers == 1
    assert ledger["outstanding"] == 0, ledger
    assert DEADLINE_MARGIN_S < AGENT_DEADLINE_S


def test_a_lost_connection_cancels_the_decisions_it_was_waiting_for() -> None:
    ledger, _, _ = _capacity_wait_past_haproxys_wait(close_at_once=True, deadline_s=None)
    assert ledger["outstanding"] == 0, ledger


def test_every_reply_field_has_a_variable() -> None:
    reply = RouteReply(replica_id="a", fallbacks=["b"], capacity_token="t", prefill_replica_id="p", prefill_url="u")
    assert set(answer_variables(200, reply)) == {"status", *REPLY_VARS} and set(REPLY_VARS) <= set(ANSWER_VARS)


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (_hello({**HELLO, "supported-versions": "1.0"}), Status.BAD_VSN),
        (_hello({**HELLO, "max-frame-size": 10}), Status.BAD_FRAME_SIZE),
        (spop.encode_frame(FrameType.ACK, 0, 0, b""), Status.INVALID),
        (spop.LENGTH.pack(3) + b"abc", Status.INVALID),
        (spop.LENGTH.pack(2**31), Status.TOO_BIG),
        # Before the HELLO: a frame larger than a HELLO, or a NOTIFY.
        (spop.LENGTH.pack(route_listener.HELLO_FRAME_BYTES + 1), Status.TOO_BIG),
        (_notify(1, 1, {SESSION: b"quick"}), Status.INVALID),
        (spop.encode_frame(FrameType.HAPROXY_DISCONNECT, 0, 0, b""), Status.NORMAL),
    ],
)
def test_a_bad_frame_or_a_disconnect_is_answered_with_agent_disconnect_then_closed(data: bytes, status: Status) -> None:
    [reply] = _exchange(data, replies=1, closes=True)
    assert reply.kind == FrameType.AGENT_DISCONNECT
    assert spop.decode_kv_list(reply.payload)["status-code"] == status


def test_agent_servers_point_at_the_agent_and_are_checked_on_serves_port(tmp_path: Path) -> None:
    runtime = FakeRuntime()
    routers = [endpoint("r", 2001).model_copy(update={"route_port": 3001})]
    syncer = make_syncer(tmp_path, runtime, [endpoint("a", 1001)], routers, [0.0])
    asyncio.run(syncer.sync_once())
    agent = runtime.servers[(AGENT_BACKEND, "r")]
    assert agent["addr"] == "127.0.0.1:3001" and agent["options"][-2:] == ["port", "2001"]
    assert runtime.servers[(ROUTER_BACKEND, "r")]["addr"] == "127.0.0.1:2001"
    # A router whose agent's port is not known yet: only its HTTP route call; the agent server comes with the port.
    routers[:] = [endpoint("q", 2002)]
    asyncio.run(syncer.sync_once())
    assert (AGENT_BACKEND, "q") not in runtime.servers and (ROUTER_BACKEND, "q") in runtime.servers
    routers[:] = [endpoint("q", 2002).model_copy(update={"route_port": 3002})]
    asyncio.run(syncer.sync_once())
    assert runtime.servers[(AGENT_BACKEND, "q")]["addr"] == "127.0.0.1:3002"
    # A fresh syncer (e.g. the frontend restarted) adopts the servers instead of replacing them.
    again = make_syncer(tmp_path, runtime, [endpoint("a", 1001)], routers, [1.0])
    assert not asyncio.run(again.sync_once()).changed and set(again.apps[0].agents.live) == {"q"}


def test_a_peer_that_sends_no_hello_in_time_is_disconnected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(route_listener, "HELLO_TIMEOUT_S", 0.2)
    [reply] = _exchange(b"", replies=1, closes=True)
    assert reply.kind == FrameType.AGENT_DISCONNECT
    assert spop.decode_kv_list(reply.payload)["status-code"] == Status.TIMEOUT


def test_connections_over_the_cap_are_closed_at_once_and_the_others_served(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(route_listener, "MAX_CONNECTIONS", 2)

    async def run() -> tuple[bytes, list[spop.Frame]]:
        listener = RouteListener(_answer, SESSION)
        port = await listener.start(LOOPBACK)
        opened = [await asyncio.open_connection(LOOPBACK, port) for _ in range(3)]
        try:
            refused = await asyncio.wait_for(opened[2][0].read(), 5)
            reader, writer = opened[0]
            writer.write(_hello() + _notify(1, 1, {SESSION: b"quick"}))
            return refused, await _read_frames(reader, 2)
        finally:
            for _, writer in opened:
                writer.close()
            listener.close()

    refused, [hello, ack] = asyncio.run(run())
    assert refused == b"" and hello.kind == FrameType.AGENT_HELLO and ack.kind == FrameType.ACK
