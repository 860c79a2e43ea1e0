"""The ports past the frontend: a request without the cluster's credential is refused with 403 and its reason before
the app sees it; health probes and metrics scrapes need none; the credential passes exactly once, nothing else."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from base.contracts import INTERNAL_CREDENTIAL_HEADER, REASON_INTERNAL_CREDENTIAL, SERVE_REASON_HEADER
from services.internal_credential import InternalCredentialMiddleware

CREDENTIAL = "the-cluster-credential"


class App:
    def __init__(self) -> None:
        self.seen: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.seen.append(scope.get("path", scope["type"]))
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})


def _call(method: str, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[App, list[dict[str, Any]]]:
    app, sent = App(), []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    asyncio.run(InternalCredentialMiddleware(app, CREDENTIAL)(scope, receive, send))
    return app, sent


def _header(value: str) -> tuple[bytes, bytes]:
    return INTERNAL_CREDENTIAL_HEADER.encode(), value.encode()


@pytest.mark.parametrize(
    "headers",
    [[], [_header("guessed")], [_header(CREDENTIAL), _header(CREDENTIAL)], [_header(CREDENTIAL[:-1])]],
    ids=["none", "wrong", "twice", "prefix"],
)
def test_a_request_without_exactly_the_credential_is_refused_before_the_app(headers: list) -> None:
    app, sent = _call("POST", "/llm/v1/chat/completions", headers)
    assert app.seen == []
    start, body = sent
    assert start["status"] == 403
    assert (SERVE_REASON_HEADER.encode(), REASON_INTERNAL_CREDENTIAL.encode()) in start["headers"]
    assert json.loads(body["body"])["error"]["code"] == 403


def test_the_credential_passes_and_probes_need_none() -> None:
    for method, path, headers in [
        ("POST", "/llm/v1/completions", [_header(CREDENTIAL)]),
        ("GET", "/-/healthz", []),
        ("GET", "/llm/metrics", []),
        ("HEAD", "/metrics", []),
    ]:
        app, sent = _call(method, path, headers)
        assert app.seen == [path] and sent[0]["status"] == 200, (method, path)


def test_only_reading_the_metrics_is_a_probe() -> None:
    app, sent = _call("POST", "/llm/metrics", [])
    assert app.seen == [] and sent[0]["status"] == 403


def test_a_lifespan_message_goes_to_the_app() -> None:
    app = App()

    async def receive() -> dict[str, Any]:
        return {"type": "lifespan.startup"}

    async def send(message: dict[str, Any]) -> None:
        raise AssertionError("nothing is answered for the app")

    asyncio.run(InternalCredentialMiddleware(app, CREDENTIAL)({"type": "lifespan"}, receive, send))
    assert app.seen == ["lifespan"]
