"""A cancelled request reaches vLLM's non-streamed handler as a disconnect (services.replica.middleware.
disconnect_on_cancel), with vLLM's own `with_cancellation` deciding."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from vllm.entrypoints.serve.utils.api_utils import with_cancellation

from services.replica.middleware.disconnect_on_cancel import DisconnectOnCancelMiddleware
from services.replica.middleware.replica_headers import Message


def _generating_app(generation: dict[str, Any]) -> FastAPI:
    """An app whose one non-streamed route is wrapped as vLLM wraps its own, and 'generates' until cancelled."""
    app = FastAPI()

    @app.post("/v1/completions")
    @with_cancellation
    async def complete(raw_request: Request) -> dict[str, str]:
        generation["started"].set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            generation["aborted"] = True
            raise
        return {"text": "finished"}

    return app


async def _cancel_mid_generation(app: Any) -> dict[str, Any]:
    """Call `app` with a POST, cancel the call's task once generation started (as Serve does when the client leaves),
    and report what the app did."""
    generation: dict[str, Any] = {"started": asyncio.Event(), "aborted": False, "sent": []}
    inner = _generating_app(generation)
    called = app(inner) if app is not None else inner
    body_sent = False
    never: asyncio.Event = asyncio.Event()

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        generation["sent"].append(message["type"])

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    task = asyncio.ensure_future(called(scope, receive, send))
    await asyncio.wait_for(generation["started"].wait(), 5)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        generation["cancelled"] = True
    await asyncio.sleep(0.05)
    # A copy: leaving `asyncio.run` cancels what still runs, an orphaned generation among it.
    return dict(generation)


def test_without_the_middleware_a_cancelled_request_generates_on() -> None:
    generation = asyncio.run(_cancel_mid_generation(None))
    assert generation["cancelled"] and not generation["aborted"]


def test_a_cancelled_request_is_aborted_and_sends_nothing() -> None:
    generation = asyncio.run(_cancel_mid_generation(DisconnectOnCancelMiddleware))
    assert generation["cancelled"] and generation["aborted"]
    assert generation["sent"] == []
