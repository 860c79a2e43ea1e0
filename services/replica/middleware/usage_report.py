"""ASGI middleware on the LLM replica: report a platform tenant's tokens (prompt + completion) to the platform's
frontend, which counts them per minute and refuses a tenant over its `tokens_per_minute` (services/platform/README.md).

Only a request the platform forwarded for a tenant with a token quota carries `x-sluice-usage` (where to report) and
`x-sluice-tenant` (an attached stack's HAProxy keeps them only with the cluster's internal credential). vLLM states a
request's usage in its answer: a JSON answer's `usage`; a stream's only with `stream_options.include_usage`, which
this middleware sets, dropping the usage event again when the client did not ask for it (the other events then carry
`"usage": null`, as OpenAI's do with the option). The report is a POST in the background once the answer ended; a
failed one is logged and counted in `sluice_usage_reports_total{outcome}`, and never delays or breaks the answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

import httpx
from prometheus_client import Counter

from base.contracts import TENANT_HEADER, TOKENS_HEADER, USAGE_PATH, USAGE_URL_HEADER
from routers.background import run_in_background
from services.internal_credential import internal_headers
from services.replica.asgi_call import call_with_body, read_body, route_path
from services.replica.middleware.replica_headers import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

USAGE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
# Where a report may go: the platform's usage listener, nothing else.
USAGE_URL = re.compile(r"^http://[A-Za-z0-9.\-\[\]:]+" + re.escape(USAGE_PATH) + "$")
# A JSON answer is read for its `usage` up to this size (an answer is a few kilobytes; a larger one is passed on
# unread and reports nothing).
MAX_JSON_ANSWER_BYTES = 4 * 1024 * 1024
REPORT_TIMEOUT_S = 5.0
_EVENT_END = b"\n\n"

REPORTS_TOTAL = Counter("sluice_usage_reports", "Tenant token reports sent to a platform, by outcome.", ["outcome"])


def _header(scope: Scope, name: str) -> str | None:
    raw = next((v for k, v in scope["headers"] if k.lower() == name.encode()), None)
    return raw.decode("latin-1").strip() if raw is not None else None


def with_usage_asked(body: bytes) -> tuple[bytes, bool]:
    """The request body with a stream's usage asked for, and whether the client had not asked (its usage event is
    then dropped); any other body unchanged."""
    try:
        request = json.loads(body)
    except ValueError:
        return body, False
    if not isinstance(request, dict) or request.get("stream") is not True:
        return body, False
    options = request.get("stream_options")
    options = options if isinstance(options, dict) else {}
    if options.get("include_usage") is True:
        return body, False
    request["stream_options"] = {**options, "include_usage": True}
    return json.dumps(request).encode(), True


def _total(usage: Any) -> int:
    if not isinstance(usage, dict):
        return 0
    total = usage.get("total_tokens")
    if isinstance(total, int):
        return total
    parts = (usage.get("prompt_tokens"), usage.get("completion_tokens"))
    return sum(part for part in parts if isinstance(part, int))


class UsageCounter:
    """Reads an answer's usage as it passes: a stream's usage event (dropped when `drop_usage_event`), or a JSON
    answer's `usage` once it is whole."""

    def __init__(self, drop_usage_event: bool) -> None:
        self.drop_usage_event = drop_usage_event
        self.stream = False
        self.tokens = 0
        self._pending = b""
        self._json = bytearray()

    def start(self, headers: list[tuple[bytes, bytes]]) -> None:
        content_type = next((v for k, v in headers if k.lower() == b"content-type"), b"")
        self.stream = content_type.startswith(b"text/event-stream")

    def feed(self, body: bytes, last: bool) -> bytes:
        """What of `body` goes on to the client."""
        if not self.stream:
            if len(self._json) + len(body) <= MAX_JSON_ANSWER_BYTES:
                self._json += body
            if last:
                self._read_json()
            return body
        events = (self._pending + body).split(_EVENT_END)
        tail = events.pop()  # an event not ended yet (empty when the data ended one)
        out = b"".join(event + _EVENT_END for event in events if self._keep(event))
        if last:
            self._pending = b""
            return out + tail
        self._pending = tail
        return out

    def _keep(self, event: bytes) -> bool:
        if b'"usage"' not in event or not event.startswith(b"data: {"):
            return True
        try:
            chunk = json.loads(event[len(b"data: ") :])
        except ValueError:
            return True
        tokens = _total(chunk.get("usage"))
        if not tokens:
            return True
        self.tokens = tokens
        return not (self.drop_usage_event and chunk.get("choices") == [])

    def _read_json(self) -> None:
        try:
            answer = json.loads(bytes(self._json))
        except ValueError:
            return
        if isinstance(answer, dict):
            self.tokens = _total(answer.get("usage"))


class UsageReportMiddleware:
    """Report the tokens of each request a platform forwarded with `x-sluice-usage` to that platform."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._client: httpx.AsyncClient | None = None
        self._reports: set[asyncio.Task] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        url = _header(scope, USAGE_URL_HEADER) if scope["type"] == "http" else None
        tenant = _header(scope, TENANT_HEADER) if url else None
        if not url or not tenant or scope["method"] != "POST" or route_path(scope) not in USAGE_PATHS:
            await self.app(scope, receive, send)
            return
        raw = await read_body(receive)
        if raw is None:
            return  # the client left before its request was whole
        body, drop = with_usage_asked(raw)
        counter = UsageCounter(drop)

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                counter.start(message.get("headers", []))
            elif message["type"] == "http.response.body":
                last = not message.get("more_body", False)
                message = {**message, "body": counter.feed(message.get("body", b""), last)}
            await send(message)

        try:
            await call_with_body(self.app, scope, receive, counted, body)
        finally:
            if counter.tokens:
                run_in_background(self._reports, self._report(url, tenant, counter.tokens))

    async def _report(self, url: str, tenant: str, tokens: int) -> None:
        if not USAGE_URL.match(url):
            REPORTS_TOTAL.labels(outcome="refused_url").inc()
            logger.warning("not reporting usage to %r: not a platform's usage listener", url)
            return
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=REPORT_TIMEOUT_S, headers=internal_headers())
        try:
            response = await self._client.post(url, headers={TENANT_HEADER: tenant, TOKENS_HEADER: str(tokens)})
            outcome = "ok" if response.status_code < 300 else f"status_{response.status_code}"
        except httpx.HTTPError as error:
            outcome = "unreachable"
            logger.warning("usage report to %s failed: %r", url, error)
        REPORTS_TOTAL.labels(outcome=outcome).inc()
