"""Lines of a server-sent event stream, ended as the SSE standard ends them: CR LF, LF or CR, and nothing else.

Python's `str.splitlines`, and with it httpx's and requests' `iter_lines`, also ends a line at U+0085, U+2028,
U+2029, VT, FF and FS/GS/RS. vLLM's JSON leaves U+0085, U+2028 and U+2029 raw (JSON allows them), and a byte-level
model generates them (the tiny model's byte tokens C2 85 decode to U+0085), so those splitters cut such an event in
two. Every reader of a stream in sluice takes its lines from here. The stream is UTF-8 whatever its headers say
(WHATWG HTML, "Event stream interpretation"); lines are split as bytes, where no UTF-8 sequence holds a CR or an LF,
and decoded whole.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator

DATA_PREFIX = "data: "
DONE = "[DONE]"

_LINE_END = re.compile(rb"\r\n|\r|\n")


class LineSplitter:
    """Incremental: `feed` each chunk as it arrives, `end` once the body is over."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[str]:
        data = self._pending + chunk
        # A CR at the end may be the first half of a CR LF: it waits for the next chunk.
        cut = len(data) - 1 if data.endswith(b"\r") else len(data)
        *lines, rest = _LINE_END.split(data[:cut])
        self._pending = rest + data[cut:]
        return [line.decode(errors="replace") for line in lines]

    def end(self) -> list[str]:
        """The last line if the body did not end it (a cut stream shows as a partial line)."""
        pending, self._pending = self._pending, b""
        return [pending.removesuffix(b"\r").decode(errors="replace")] if pending else []


def lines(body: bytes | str) -> list[str]:
    """The lines of a whole body."""
    splitter = LineSplitter()
    return splitter.feed(body.encode() if isinstance(body, str) else body) + splitter.end()


def iter_lines(chunks: Iterable[bytes]) -> Iterator[str]:
    splitter = LineSplitter()
    for chunk in chunks:
        yield from splitter.feed(chunk)
    yield from splitter.end()


async def aiter_lines(chunks: AsyncIterable[bytes]) -> AsyncIterator[str]:
    splitter = LineSplitter()
    async for chunk in chunks:
        for line in splitter.feed(chunk):
            yield line
    for line in splitter.end():
        yield line


def data_payloads(body_lines: Iterable[str]) -> list[str]:
    """The payloads of the `data:` lines, in order."""
    return [line[len(DATA_PREFIX) :] for line in body_lines if line.startswith(DATA_PREFIX)]
