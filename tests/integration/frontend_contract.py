"""Checks every response the integration suite receives through a sluice frontend against the error contract:
a 5xx always carries `x-serve-reason` (HAProxy's own errors, routing failures and a replica's own 5xx alike).

Frontends register their port when they start; `checking_frontend_responses()` wraps httpx's `send` so that every
client, sync or async, streaming or not, is checked as soon as the response headers arrive.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from sluice.contracts import SERVE_REASON_HEADER

_frontend_ports: set[int] = set()
checked = {"responses": 0}


def register_frontend(port: int) -> None:
    _frontend_ports.add(port)


def check_frontend_response(response: httpx.Response) -> None:
    if response.request.url.port not in _frontend_ports:
        return
    checked["responses"] += 1
    if response.status_code >= 500:
        assert response.headers.get(SERVE_REASON_HEADER), (
            f"{response.status_code} from the frontend without {SERVE_REASON_HEADER}: "
            f"{response.request.method} {response.request.url} {dict(response.headers)}"
        )


@contextmanager
def checking_frontend_responses() -> Iterator[None]:
    sync_send, async_send = httpx.Client.send, httpx.AsyncClient.send

    def send(self: httpx.Client, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        response = sync_send(self, request, **kwargs)
        check_frontend_response(response)
        return response

    async def asend(self: httpx.AsyncClient, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        response = await async_send(self, request, **kwargs)
        check_frontend_response(response)
        return response

    httpx.Client.send, httpx.AsyncClient.send = send, asend  # type: ignore[method-assign]
    try:
        yield
    finally:
        httpx.Client.send, httpx.AsyncClient.send = sync_send, async_send  # type: ignore[method-assign]
