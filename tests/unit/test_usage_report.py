"""UsageReportMiddleware: a stream's usage is asked for and its event dropped when the client did not ask; a JSON
answer's usage is read as it passes; each request a platform marked is reported once, with its tokens, to the
platform's usage listener only."""

from __future__ import annotations

import asyncio
import json

import httpx

from base.contracts import TENANT_HEADER, TOKENS_HEADER, USAGE_PATH, USAGE_URL_HEADER
from services.replica.middleware.replica_headers import Message
from services.replica.middleware.usage_report import UsageReportMiddleware

PLATFORM = f"http://127.0.0.1:9999{USAGE_PATH}"
USAGE = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}


def _scope(url: str | None = PLATFORM, tenant: str = "alpha", path: str = "/v1/completions") -> dict:
    headers = [(b"content-type", b"application/json")]
    if url is not None:
        headers += [(USAGE_URL_HEADER.encode(), url.encode()), (TENANT_HEADER.encode(), tenant.encode())]
    return {"type": "http", "method": "POST", "path": path, "headers": headers}


class VLLMLike:
    """Streams two token events, then the usage event when the request asked for it; or answers JSON."""

    def __init__(self) -> None:
        self.request: dict = {}

    async def __call__(self, scope, receive, send) -> None:
        self.request = json.loads((await receive())["body"])
        if not self.request.get("stream"):
            body = json.dumps({"choices": [{"text": "ab"}], "usage": USAGE}).encode()
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
            )
            await send({"type": "http.response.body", "body": body[:10], "more_body": True})
            await send({"type": "http.response.body", "body": body[10:], "more_body": False})
            return
        asked = (self.request.get("stream_options") or {}).get("include_usage")
        events = [{"choices": [{"text": "a"}], "usage": None}, {"choices": [{"text": "b"}], "usage": None}]
        if asked:
            events.append({"choices": [], "usage": USAGE})
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for event in events:
            line = b"data: " + json.dumps(event).encode() + b"\n\n"
            # An event may arrive cut in two.
            await send({"type": "http.response.body", "body": line[:9], "more_body": True})
            await send({"type": "http.response.body", "body": line[9:], "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def _run(scope: dict, body: dict) -> tuple[VLLMLike, bytes, list[httpx.Request]]:
    app = VLLMLike()
    middleware = UsageReportMiddleware(app)
    reports: list[httpx.Request] = []

    def platform(request: httpx.Request) -> httpx.Response:
        reports.append(request)
        return httpx.Response(204)

    middleware._client = httpx.AsyncClient(transport=httpx.MockTransport(platform))
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    async def call() -> None:
        await middleware(scope, receive, send)
        await asyncio.gather(*middleware._reports)

    asyncio.run(call())
    answer = b"".join(message.get("body", b"") for message in sent if message["type"] == "http.response.body")
    return app, answer, reports


def _reported(reports: list[httpx.Request]) -> list[tuple[str, str, str]]:
    return [(str(r.url), r.headers[TENANT_HEADER], r.headers[TOKENS_HEADER]) for r in reports]


def test_a_stream_that_did_not_ask_for_usage_reports_it_without_the_client_seeing_the_usage_event() -> None:
    app, answer, reports = _run(_scope(), {"prompt": "hi", "stream": True, "stream_options": {"x": 1}})
    assert app.request["stream_options"] == {"x": 1, "include_usage": True}
    # Every event as it was, each ended once; only the usage event is gone.
    events = answer.split(b"\n\n")
    assert len(events) == 4 and events[-2:] == [b"data: [DONE]", b""] and b'"choices": []' not in answer
    assert _reported(reports) == [(PLATFORM, "alpha", "12")]


def test_a_stream_that_asked_for_usage_keeps_its_event_and_a_json_answer_passes_unchanged() -> None:
    _, answer, reports = _run(_scope(), {"prompt": "hi", "stream": True, "stream_options": {"include_usage": True}})
    assert b'"choices": [], "usage"' in answer and _reported(reports) == [(PLATFORM, "alpha", "12")]
    _, answer, reports = _run(_scope(tenant="beta"), {"prompt": "hi"})
    assert json.loads(answer)["usage"] == USAGE and _reported(reports) == [(PLATFORM, "beta", "12")]


def test_a_request_no_platform_marked_is_untouched_and_a_report_goes_nowhere_but_a_usage_listener() -> None:
    app, answer, reports = _run(_scope(url=None), {"prompt": "hi", "stream": True})
    assert "stream_options" not in app.request and b'"usage": null' in answer and not reports
    _, _, reports = _run(_scope(url="http://169.254.169.254/latest/meta-data"), {"prompt": "hi", "stream": True})
    assert not reports
