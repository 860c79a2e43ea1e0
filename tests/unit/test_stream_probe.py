"""The stream probe of the benches (`loadtests/stream_probe.py`): a stream cut in the middle of an event is named with
the URL and the replica and path that served it, not a bare JSON error."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from base.contracts import REPLICA_HEADER, SERVE_PATH_HEADER
from loadtests.stream_probe import one_stream

EVENT = b'data: {"choices": [{"text": "ka"}]}\n\n'


def _client(body: bytes) -> httpx.AsyncClient:
    headers = {"content-type": "text/event-stream", REPLICA_HEADER: "r1", SERVE_PATH_HEADER: "direct"}
    transport = httpx.MockTransport(lambda request: httpx.Response(200, headers=headers, content=body))
    return httpx.AsyncClient(transport=transport)


async def _probe(body: bytes) -> float:
    async with _client(body) as client:
        return (await one_stream(client, "http://sluice.test", "tiny", 2)).ttft_s


def test_a_whole_stream_is_measured() -> None:
    assert asyncio.run(_probe(EVENT * 2 + b"data: [DONE]\n\n")) >= 0


def test_a_stream_cut_mid_event_names_the_url_the_replica_and_the_path() -> None:
    with pytest.raises(RuntimeError, match=r"http://sluice.test: an event cut mid-stream .*'r1'.*'direct'"):
        asyncio.run(_probe(EVENT + b'data: {"choices": [{"te'))


def test_an_event_holding_unicode_line_breaks_is_not_taken_for_a_cut_one() -> None:
    """vLLM leaves U+0085 and U+2028 raw in its JSON; `str.splitlines` (httpx's `aiter_lines`) cut such an event,
    and one bench run died on it."""
    text = '{"choices": [{"text": "ka\u0085lo\u2028"}]}'
    usage = b'data: {"choices": [], "usage": {"completion_tokens": 2}}\n\n'

    async def measured() -> int:
        async with _client(b"data: " + text.encode() + b"\n\n" + usage + b"data: [DONE]\n\n") as client:
            return (await one_stream(client, "http://sluice.test", "tiny", 2)).completion_tokens

    assert asyncio.run(measured()) == 2
