"""Requests that httpx cannot send: headers followed by a partial, stalled or dripped body, on a raw socket."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

LOOPBACK = "127.0.0.1"


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes
    elapsed_s: float  # from the moment the headers and the first body bytes were sent


def request_head(path: str, content_length: int, *headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {LOOPBACK}", "Content-Type: application/json"]
    lines += [f"Content-Length: {content_length}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, body


async def partial_request(
    port: int, head: bytes, body_start: bytes, timeout_s: float, drip: bytes = b"", drip_every_s: float = 0.5
) -> RawResponse:
    """Send the headers and `body_start`, then `drip` one byte every `drip_every_s` (never the whole body), and
    read until the server closes the connection (at most `timeout_s`)."""
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    writer.write(head + body_start)
    await writer.drain()
    sent = time.monotonic()

    async def drip_bytes() -> None:
        for byte in drip:
            await asyncio.sleep(drip_every_s)
            writer.write(bytes([byte]))
            await writer.drain()

    dripping = asyncio.create_task(drip_bytes())
    try:
        raw = await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        dripping.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await dripping
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    status, headers, body = parse_response(raw)
    return RawResponse(status, headers, body, time.monotonic() - sent)
