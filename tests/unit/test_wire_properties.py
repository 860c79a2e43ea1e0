"""Property-based tests (hypothesis) of what parses untrusted bytes: the router's route agent (SPOP frames however
the network cuts them, and any bytes at all), the route call's body fields, the load generator's SSE reader and
the spec loader. Each either answers or refuses in its documented way, never raises."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from base.agent_wire import BODY_ARG, MESSAGE, Answer
from base.contracts import REQUEST_ID_HEADER
from base.route_wire import RouteReply
from builders.specs import parse_spec
from loadtests.sse_timing import StreamRow, record_stream
from services.router import spop
from services.router.route_listener import RouteListener, _AgentConnection
from services.router.route_request import fields_from_body, route_request_from
from services.router.spop import FrameType
from topologies.problems import SpecError

SESSION_HEADER = "x-session-id"
PROPERTY_SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "wrote after close"
        self.written.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def _feed(chunks: list[bytes]) -> tuple[_Transport, list[tuple[dict[str, str], bytes]]]:
    """Feed a route agent's connection these chunks; the transport and the calls the answer got."""
    calls: list[tuple[dict[str, str], bytes]] = []

    async def answer(headers: Any, body: bytes) -> tuple[int, Answer]:
        calls.append((dict(headers), body))
        return 200, RouteReply(replica_id="r")

    async def run() -> _Transport:
        transport = _Transport()
        connection = _AgentConnection(RouteListener(answer, SESSION_HEADER))
        connection.connection_made(transport)  # type: ignore[arg-type]
        for chunk in chunks:
            if transport.closed:
                break
            connection.data_received(chunk)
        while connection.pending:
            await asyncio.gather(*connection.pending)
        connection.connection_lost(None)
        return transport

    return asyncio.run(run()), calls


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(cut, len(data)) for cut in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True) if data[a:b]]


def _frame_kinds(written: list[bytes]) -> list[int]:
    data = b"".join(written)
    kinds, offset = [], 0
    while offset < len(data):
        (length,) = spop.LENGTH.unpack_from(data, offset)
        kinds.append(data[offset + 4])
        offset += 4 + length
    return kinds


header_values = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=20)
HELLO = spop.encode_frame(
    FrameType.HAPROXY_HELLO, 0, 0, spop.encode_kv_list({"supported-versions": "2.0", "max-frame-size": 16380})
)


@PROPERTY_SETTINGS
@given(
    body=st.binary(max_size=600),
    session=st.none() | header_values,
    request_id=st.none() | header_values,
    cuts=st.lists(st.integers(min_value=0, max_value=900), max_size=8),
)
def test_a_route_call_cut_anywhere_is_answered_once_with_its_exact_body(
    body: bytes, session: str | None, request_id: str | None, cuts: list[int]
) -> None:
    arguments: dict[str, spop.Value] = {BODY_ARG: body}
    for name, value in ((SESSION_HEADER, session), (REQUEST_ID_HEADER, request_id)):
        arguments[name] = value.encode() if value is not None else None
    payload = spop.encode_string(MESSAGE) + bytes((len(arguments),)) + spop.encode_kv_list(arguments)
    notify = spop.encode_frame(FrameType.NOTIFY, 5, 1, payload)
    transport, calls = _feed(_split(HELLO + notify, cuts))
    assert len(calls) == 1 and calls[0][1] == body
    assert calls[0][0].get(SESSION_HEADER) == session and calls[0][0].get(REQUEST_ID_HEADER) == request_id
    assert _frame_kinds(transport.written) == [FrameType.AGENT_HELLO, FrameType.ACK] and not transport.closed


@PROPERTY_SETTINGS
@given(data=st.binary(max_size=400), cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6))
def test_any_bytes_get_whole_frames_back_and_never_an_exception(data: bytes, cuts: list[int]) -> None:
    transport, calls = _feed(_split(HELLO + data, cuts))
    kinds = _frame_kinds(transport.written)
    assert kinds[0] == FrameType.AGENT_HELLO and len(calls) <= len(kinds) - 1
    assert set(kinds[1:]) <= {FrameType.ACK, FrameType.AGENT_DISCONNECT}
    if FrameType.AGENT_DISCONNECT in kinds:
        assert kinds[-1] == FrameType.AGENT_DISCONNECT and transport.closed


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@PROPERTY_SETTINGS
@given(document=st.dictionaries(st.sampled_from(["model", "user", "messages", "x"]), json_values, max_size=4))
def test_body_fields_are_the_json_strings_whether_the_body_is_whole_or_cut(document: dict[str, Any]) -> None:
    body = json.dumps(document).encode()
    whole = fields_from_body(body, truncated=False)
    for name in ("model", "user"):
        value = document.get(name)
        assert whole[name] == (value if isinstance(value, str) and value else None)
    cut = fields_from_body(body[: len(body) // 2], truncated=True)
    assert all(found is None or isinstance(found, str) for found in cut.values())


@PROPERTY_SETTINGS
@given(body=st.binary(max_size=300), truncated=st.sampled_from([None, "10/20", "5/*", "x/y", "20/10"]))
def test_a_route_request_reads_from_any_body_and_header(body: bytes, truncated: str | None) -> None:
    headers = {"x-body-truncated": truncated} if truncated is not None else {}
    request = route_request_from(headers, body, "x-session-id")
    assert request.body_prefix == body and request.request_id


sse_lines = st.one_of(
    st.text(max_size=40),
    st.builds(lambda value: f"data: {json.dumps(value)}", json_values),
    st.just("data: [DONE]"),
    st.builds(lambda text: "data: " + json.dumps({"choices": [{"delta": {"content": text}}]}), st.text(max_size=5)),
)


@PROPERTY_SETTINGS
@given(lines=st.lists(sse_lines, max_size=12))
def test_the_sse_reader_takes_any_lines_and_times_only_text(lines: list[str]) -> None:
    row = StreamRow("short_long", "s", 0.0, 0.0)
    output = record_stream(row, 200, {}, 0.01, [(0.1 * (i + 1), line) for i, line in enumerate(lines)])
    assert (row.ttft_s is None) == (output.text == "") and row.chunks == len(row.gaps_s) + (row.ttft_s is not None)


@PROPERTY_SETTINGS
@given(data=json_values)
def test_the_spec_loader_returns_a_spec_or_names_the_problems(data: Any) -> None:
    try:
        parse_spec(data, "fuzzed.yaml")
    except SpecError as error:
        assert error.problems
