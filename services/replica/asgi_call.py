"""Call an ASGI app in-process and stream its response: the DeploymentHandle path of a replica.

The handle path runs the very app (and middleware) that serves the replica's HTTP port, so both
paths give the same status, headers and SSE bytes. Closing the generator early is a client
disconnect: the app sees `http.disconnect` and vLLM aborts the engine request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

from base.contracts import SERVE_REASON_HEADER
from base.openai_error import openai_error
from services.replica.middleware.replica_headers import ASGIApp, Message, Receive, Scope, Send


class ResponseStart(BaseModel):
    """First item of a streamed handle response."""

    status: int
    headers: list[tuple[str, str]]

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)


def route_path(scope: Scope) -> str:
    """The request's path below the app's route prefix (what the app behind it matches)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


async def send_openai_error(
    send: Send, status: int, reason: str, message: str, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    """An OpenAI-style JSON error with `x-serve-reason: <reason>` (and `extra` headers)."""
    body = json.dumps(openai_error(message, status)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (SERVE_REASON_HEADER.encode(), reason.encode()),
        *(extra or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def call_with_body(app: ASGIApp, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
    """`app` on `body`, the request's body read already (and perhaps changed): it arrives whole, its length in
    `content-length`; later receives (a disconnect) come from `receive`."""
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
    scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    await app(scope, replay, send)


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None when the client disconnected first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def http_scope(method: str, path: str, headers: dict[str, str]) -> dict[str, Any]:
    path_only, _, query = path.partition("?")
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method.upper(),
        "scheme": "http",
        "path": path_only,
        "raw_path": path_only.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
        "state": {},
    }


async def stream_asgi(
    app: ASGIApp, method: str, path: str, body: bytes, headers: dict[str, str]
) -> AsyncIterator[ResponseStart | bytes]:
    """Yield a `ResponseStart`, then each non-empty body chunk as the app sends it."""
    messages: asyncio.Queue[Message | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    request_sent = False
    headers = {"content-length": str(len(body)), **headers} if body else headers

    async def receive() -> Message:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(http_scope(method, path, headers), receive, send)
        finally:
            await messages.put(None)

    task = asyncio.create_task(run())
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseStart(
                    status=message["status"],
                    headers=[(k.decode(), v.decode()) for k, v in message.get("headers", [])],
                )
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        await task
    finally:
        disconnected.set()
        if not task.done():
            task.cancel()
