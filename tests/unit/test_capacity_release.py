"""CapacityReleaseMiddleware releases a request's capacity token exactly once, whichever way it ends."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from base.contracts import CAPACITY_TOKEN_HEADER
from services.replica.middleware.capacity_release import CapacityReleaseMiddleware
from services.replica.middleware.replica_headers import Message

TOKEN = "tok-1"


class FakeLedger:
    def __init__(self, fail: bool = False) -> None:
        self.released: list[str] = []
        self.fail = fail

    async def release(self, token_id: str) -> bool:
        self.released.append(token_id)
        if self.fail:
            raise ConnectionError("ledger unreachable")
        return True


def scope(token: str | None = TOKEN) -> dict:
    headers = [(b"content-type", b"application/json")]
    if token is not None:
        headers.append((CAPACITY_TOKEN_HEADER.encode(), token.encode()))
    return {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}


class Client:
    """The server side of one request: what the app sent, and a disconnect the test can trigger."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.gone = asyncio.Event()
        self.streaming = asyncio.Event()

    async def receive(self) -> Message:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)
        if message.get("more_body"):
            self.streaming.set()


async def streaming_app(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def failing_app(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    raise RuntimeError("engine died")


async def endless_app(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    while True:
        await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
        await asyncio.sleep(0.01)


async def app_ending_twice(scope, receive, send) -> None:
    """The final body is sent, then the client disconnects, then the app fails: three ends, one release."""
    await streaming_app(scope, receive, send)
    assert (await receive())["type"] == "http.disconnect"
    raise RuntimeError("late failure")


def errors_counted() -> float:
    return REGISTRY.get_sample_value("sluice_capacity_releases_total", {"outcome": "error"}) or 0.0


async def settle_until(middleware: CapacityReleaseMiddleware, ledger: FakeLedger) -> None:
    while not ledger.released:
        await settle(middleware)


async def settle(middleware: CapacityReleaseMiddleware) -> None:
    await asyncio.sleep(0)
    await asyncio.gather(*middleware._releases)


def test_released_once_after_the_final_body() -> None:
    async def run() -> None:
        ledger, client = FakeLedger(), Client()
        middleware = CapacityReleaseMiddleware(streaming_app, ledger)
        await middleware(scope(), client.receive, client.send)
        await settle(middleware)
        assert ledger.released == [TOKEN]
        assert client.sent[-1] == {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}

    asyncio.run(run())


def test_released_at_the_final_body_not_later() -> None:
    async def run() -> None:
        ledger, client = FakeLedger(), Client()
        released_before_return: list[list[str]] = []

        async def app(scope, receive, send) -> None:
            await streaming_app(scope, receive, send)
            await asyncio.sleep(0.01)
            released_before_return.append(list(ledger.released))

        middleware = CapacityReleaseMiddleware(app, ledger)
        await middleware(scope(), client.receive, client.send)
        await settle(middleware)
        assert released_before_return == [[TOKEN]]
        assert ledger.released == [TOKEN]

    asyncio.run(run())


def test_released_once_on_error() -> None:
    async def run() -> None:
        ledger, client = FakeLedger(), Client()
        middleware = CapacityReleaseMiddleware(failing_app, ledger)
        with pytest.raises(RuntimeError, match="engine died"):
            await middleware(scope(), client.receive, client.send)
        await settle(middleware)
        assert ledger.released == [TOKEN]

    asyncio.run(run())


def test_released_once_on_disconnect_mid_stream() -> None:
    async def run() -> None:
        ledger, client = FakeLedger(), Client()
        cleaned_up = asyncio.Event()

        async def app(scope, receive, send) -> None:
            """Streams until the client disconnects, then cleans up (aborts the engine request)."""
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
            assert (await receive())["type"] == "http.disconnect"
            await cleaned_up.wait()

        middleware = CapacityReleaseMiddleware(app, ledger)
        call = asyncio.create_task(middleware(scope(), client.receive, client.send))
        await client.streaming.wait()
        assert ledger.released == []
        client.gone.set()
        # Released at the disconnect, before the app has finished cleaning up.
        await asyncio.wait_for(settle_until(middleware, ledger), 1.0)
        assert not call.done()
        cleaned_up.set()
        await call
        await settle(middleware)
        assert ledger.released == [TOKEN]
        assert not any(m["type"] == "http.response.body" and not m.get("more_body") for m in client.sent)

    asyncio.run(run())


def test_released_once_when_the_request_is_cancelled_mid_stream() -> None:
    async def run() -> None:
        ledger, client = FakeLedger(), Client()
        middleware = CapacityReleaseMiddleware(endless_app, ledger)
        call = asyncio.create_task(middleware(scope(), client.receive, client.send))
        await client.streaming.wait()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await settle(middleware)
        assert ledger.released == [TOKEN]

    asyncio.run(run())


def test_nothing_released_without_the_header() -> None:
    async def run() -> None:
        ledger = FakeLedger()
        middleware = CapacityReleaseMiddleware(streaming_app, ledger)
        for token in (None, "", "  "):
            await middleware(scope(token), Client().receive, Client().send)
        with pytest.raises(RuntimeError):
            await CapacityReleaseMiddleware(failing_app, ledger)(scope(None), Client().receive, Client().send)
        await settle(middleware)
        assert ledger.released == []

    async def lifespan_passthrough() -> None:
        ledger = FakeLedger()
        seen: list[str] = []

        async def app(scope, receive, send) -> None:
            seen.append(scope["type"])

        await CapacityReleaseMiddleware(app, ledger)({"type": "lifespan"}, Client().receive, Client().send)
        assert seen == ["lifespan"] and ledger.released == []

    asyncio.run(run())
    asyncio.run(lifespan_passthrough())


def test_several_ends_release_once() -> None:
    async def run() -> None:
        ledger, client = FakeLedger(), Client()
        client.gone.set()
        middleware = CapacityReleaseMiddleware(app_ending_twice, ledger)
        with pytest.raises(RuntimeError, match="late failure"):
            await middleware(scope(), client.receive, client.send)
        await settle(middleware)
        assert ledger.released == [TOKEN]

    asyncio.run(run())


def test_a_failing_release_is_counted_and_does_not_break_the_response() -> None:
    before = errors_counted()

    async def run() -> None:
        ledger, client = FakeLedger(fail=True), Client()
        middleware = CapacityReleaseMiddleware(streaming_app, ledger)
        await middleware(scope(), client.receive, client.send)
        await settle(middleware)
        assert ledger.released == [TOKEN]
        assert [m["type"] for m in client.sent] == ["http.response.start"] + ["http.response.body"] * 2

    asyncio.run(run())
    assert errors_counted() == before + 1
