"""A kept-alive HTTP/1.1 connection on asyncio streams that POSTs a body and yields the response body as it arrives
(chunked or sized): a load client's whole per-request cost is parsing what it reads.

Why not httpx: with 64 streams open its connection pool scans every connection for every request and read
(`_assign_requests_to_connections`, `is_idle`), which took a whole core of these machines at 50 requests per
second, so the client, not the stack, set the pace. One connection per simulated user, opened again after the server
closed it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass, field

# Connect and each read: a stream that says nothing for this long is a failure.
READ_TIMEOUT_S = 120.0


@dataclass
class Response:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)


class StreamConnection:
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def _read(self, read: Awaitable[bytes]) -> bytes:
        return await asyncio.wait_for(read, READ_TIMEOUT_S)

    async def post(
        self, path: str, body: bytes, headers: Mapping[str, str], response: Response
    ) -> AsyncIterator[bytes]:
        """POST `body`; fills `response` once its head arrived, then yields its body's bytes as they come."""
        if self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port), READ_TIMEOUT_S
            )
        reader, writer = self._reader, self._writer
        assert reader is not None
        head = [f"POST {path} HTTP/1.1", f"Host: {self.host}:{self.port}", "Content-Type: application/json"]
        head += [f"Content-Length: {len(body)}", "Accept-Encoding: identity"]
        head += [f"{name}: {value}" for name, value in headers.items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        try:
            status_line = await self._read(reader.readline())
            response.status = int(status_line.split()[1])
            while (line := await self._read(reader.readline())) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                response.headers[name.strip().lower()] = value.strip()
            if response.headers.get("transfer-encoding", "").lower() == "chunked":
                while size := int((await self._read(reader.readline())).split(b";")[0], 16):
                    yield await self._read(reader.readexactly(size))
                    await self._read(reader.readexactly(2))
                await self._read(reader.readline())
            elif "content-length" in response.headers:
                yield await self._read(reader.readexactly(int(response.headers["content-length"])))
            else:
                while chunk := await self._read(reader.read(65536)):
                    yield chunk
                self.close()
            if response.headers.get("connection", "").lower() == "close":
                self.close()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None
