"""Closed-loop streaming clients for the tests that move traffic between paths: each user streams one request after
another, bounded in count and time, and every stream records its path, status and whether it reached `[DONE]`."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx

from base.contracts import SERVE_PATH_HEADER, SESSION_HEADER_DEFAULT
from tests.support.sse import DONE, data_payloads

# Streams one user sends at most, whatever `run_s` allows.
MAX_TURNS = 200


@dataclass
class Stream:
    started: float
    path: str | None = None
    status: int = 0
    done: bool = False


async def streaming_users(
    url: str, body: dict[str, Any], users: int, run_s: float, done: asyncio.Event | None = None
) -> list[Stream]:
    """`users` clients, each POSTing `body` (a streamed request) to `url` one after another for `run_s` seconds (or
    until `done` is set, if sooner), each request its own session."""
    streams: list[Stream] = []
    stop = time.monotonic() + run_s

    async def user(client: httpx.AsyncClient, index: int) -> None:
        turn = 0
        while time.monotonic() < stop and turn < MAX_TURNS and not (done is not None and done.is_set()):
            turn += 1
            stream = Stream(started=time.monotonic())
            streams.append(stream)
            headers = {SESSION_HEADER_DEFAULT: f"stream-{index}-{turn}"}
            async with client.stream("POST", url, json=body, headers=headers) as response:
                stream.status, stream.path = response.status_code, response.headers.get(SERVE_PATH_HEADER)
                text = (await response.aread()).decode()
            stream.done = data_payloads(text)[-1:] == [DONE]

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=users)) as client:
        await asyncio.gather(*(user(client, i) for i in range(users)))
    return streams
