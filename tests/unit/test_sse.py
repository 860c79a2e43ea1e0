"""SSE lines end at CR LF, LF or CR only: an event whose JSON holds a raw U+0085 or U+2028 stays whole."""

from __future__ import annotations

import asyncio
import json

from base import sse

# vLLM's JSON leaves these raw; the tiny model's byte tokens C2 85 decode to the first.
UNICODE_LINE_BREAKS = "\x85\u2028\u2029"


def _event(text: str) -> str:
    return "data: " + json.dumps({"choices": [{"text": text}]}, ensure_ascii=False) + "\n\n"


def test_an_event_holding_unicode_line_breaks_is_one_line() -> None:
    body = _event(f"ka{UNICODE_LINE_BREAKS}lo\x0b\x0c") + "data: [DONE]\n\n"
    assert len(body.splitlines()) > len(sse.lines(body))  # what httpx's and requests' iter_lines would see
    payloads = sse.data_payloads(sse.lines(body))
    assert payloads[-1] == sse.DONE
    assert json.loads(payloads[0])["choices"][0]["text"] == f"ka{UNICODE_LINE_BREAKS}lo\x0b\x0c"


def test_every_standard_line_end_ends_a_line_and_nothing_else() -> None:
    assert sse.lines("a\r\nb\nc\rd\r\n\r\ne") == ["a", "b", "c", "d", "", "e"]


def test_a_cr_lf_split_between_chunks_is_one_line_end() -> None:
    assert list(sse.iter_lines([b"data: 1\r", b"\ndata: 2\r", b"\r\n"])) == ["data: 1", "data: 2", ""]


def test_a_character_split_between_chunks_is_decoded_whole() -> None:
    encoded = _event("\u2028é").encode()
    middle = encoded.index("\u2028".encode()) + 1
    got = list(sse.iter_lines([encoded[:middle], encoded[middle:]]))
    assert json.loads(got[0][len("data: ") :])["choices"][0]["text"] == "\u2028é"


def test_a_body_cut_mid_event_ends_with_the_partial_line() -> None:
    assert sse.lines(b'data: {"a": 1}\n\ndata: {"cho') == ['data: {"a": 1}', "", 'data: {"cho']
    assert sse.lines(b"data: 1\r") == ["data: 1"]


def test_the_async_reader_gives_the_same_lines() -> None:
    chunks = [b"data: 1\r", b"\ndata: \xe2\x80", b"\xa8\n\n", b"tail"]

    async def read() -> list[str]:
        async def produce():
            for chunk in chunks:
                yield chunk

        return [line async for line in sse.aiter_lines(produce())]

    assert asyncio.run(read()) == list(sse.iter_lines(chunks)) == ["data: 1", "data: \u2028", "", "tail"]
