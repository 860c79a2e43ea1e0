"""Checks every response the integration suite receives through a sluice frontend against the error contract:
a 5xx always carries `x-serve-reason` (HAProxy's own errors, routing failures and a replica's own 5xx alike), and
a refusal of the frontend's protection (401, 408, 413, 414, 429, 431 not sent by a replica) carries its reason (on a
platform's frontend, a 429 may carry one of the platform's own: `base.contracts.PLATFORM_REASONS`).

Frontends register their port when they start; `checking_frontend_responses()` wraps httpx's `send` so that every
client, sync or async, streaming or not, is checked as soon as the response headers arrive.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import httpx

from base.contracts import PLATFORM_REASONS, PROTECTION_REASONS, REPLICA_HEADER, SERVE_REASON_HEADER

# vLLM's `ErrorInfo` fields (tests/unit/test_openai_error.py holds them to vLLM's own model).
OPENAI_ERROR_FIELDS = {"message", "type", "param", "code"}

_frontend_ports: set[int] = set()
_platform_ports: set[int] = set()
checked = {"responses": 0}


def register_frontend(port: int, platform: bool = False) -> None:
    _frontend_ports.add(port)
    if platform:
        _platform_ports.add(port)


def check_frontend_response(response: httpx.Response) -> None:
    if response.request.url.port not in _frontend_ports:
        return
    checked["responses"] += 1
    if response.status_code >= 500:
        assert response.headers.get(SERVE_REASON_HEADER), (
            f"{response.status_code} from the frontend without {SERVE_REASON_HEADER}: "
            f"{response.request.method} {response.request.url} {dict(response.headers)}"
        )
    reason = response.headers.get(SERVE_REASON_HEADER)
    platforms = response.request.url.port in _platform_ports
    if platforms and PLATFORM_REASONS.get(reason or "") == response.status_code:
        return
    if response.status_code in PROTECTION_REASONS and REPLICA_HEADER not in response.headers:
        assert reason == PROTECTION_REASONS[response.status_code], (
            f"{response.status_code} from the frontend without its reason: {dict(response.headers)}"
        )


def assert_frontend_error(status: int, headers: Mapping[str, str], body: bytes, expected_status: int) -> None:
    """A refusal the frontend answered itself: the status, its reason from the contract, no replica, and an
    OpenAI-style JSON error body (`headers` with lower-case names)."""
    assert status == expected_status, (status, dict(headers), body[:300])
    assert headers.get(SERVE_REASON_HEADER) == PROTECTION_REASONS[expected_status], dict(headers)
    assert REPLICA_HEADER not in headers
    assert headers.get("content-type") == "application/json"
    error = json.loads(body)["error"]
    assert error["code"] == expected_status and error["type"] and error["message"].startswith("sluice")
    assert set(error) == OPENAI_ERROR_FIELDS, f"not the OpenAI error shape vLLM's errors have: {error}"


def assert_refused(response: httpx.Response, expected_status: int) -> None:
    assert_frontend_error(response.status_code, response.headers, response.read(), expected_status)


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
