"""The decode side of prefill/decode: ASGI middleware that runs a request's prefill on a prefill replica, then lets
vLLM's app here decode from the transferred KV blocks and stream back through HAProxy.

The prefill call goes straight to the prefill replica the router chose (`max_tokens` 1, `kv_transfer_params` asking
for a remote decode); its answer's `kv_transfer_params` go into the original body. A client's own are dropped. Only
a URL of the prefill app's replicas is called (`KnownPrefillURLs`; any other is `prefill_unrouted`). The steps, the
failures (`prefill_failed`, `prefill_unrouted`) and the local fallback: services/replica/README.md.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from prometheus_client import Counter

from base.contracts import (
    PREFILL_BY_CALLER_HEADER,
    PREFILL_FALLBACK_HEADER,
    PREFILL_REPLICA_HEADER,
    PREFILL_URL_HEADER,
    REASON_PREFILL_FAILED,
    REASON_PREFILL_UNROUTED,
    REQUEST_ID_HEADER,
    SERVED_PREFILL_HEADER,
    TRACEPARENT_HEADER,
)
from services.replica.asgi_call import call_with_body, read_body, route_path, send_openai_error
from services.replica.middleware.replica_headers import ASGIApp, Message, Receive, Scope, Send
from services.replica.prefill_endpoints import KnownPrefillURLs

PREFILL_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
# What the prefill request asks of vLLM's KV connector: keep the blocks for a remote decode.
REMOTE_DECODE_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Fields a one-token, non-streamed prefill must not carry (`min_tokens` above 1 would be refused).
_DECODE_ONLY_FIELDS = ("stream", "stream_options", "min_tokens", "max_completion_tokens", "kv_transfer_params")
# Outcomes of the counter below.
OUTCOME_REMOTE = "remote"
OUTCOME_LOCAL = "local_fallback"
OUTCOME_FAILED = "failed"
OUTCOME_REJECTED = "rejected"
OUTCOME_CANCELLED = "cancelled"
OUTCOME_BY_CALLER = "by_caller"

PREFILL_REQUESTS_METRIC = "sluice_prefill_requests"
PREFILL_REQUESTS = Counter(
    PREFILL_REQUESTS_METRIC,
    "Requests this decode replica served, by the replica that ran their prefill and how it went.",
    ["prefill_replica", "outcome"],
)


class PrefillFailed(Exception):
    """The prefill phase could not give KV transfer parameters; `reason` is the client's `X-Serve-Reason`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class PrefillRejected(Exception):
    """The prefill replica refused the request itself (4xx): the client gets that answer."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def prefill_body(request: dict[str, Any]) -> dict[str, Any]:
    """The prefill replica's request: one token, not streamed, blocks kept for a remote decode."""
    body = {k: v for k, v in request.items() if k not in _DECODE_ONLY_FIELDS}
    body.update(max_tokens=1, stream=False, kv_transfer_params=dict(REMOTE_DECODE_PARAMS))
    return body


def _header(scope: Scope, name: str) -> str | None:
    raw = name.encode()
    return next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == raw), None)


class RemotePrefillMiddleware:
    """Runs each completion request's prefill on the prefill replica the router chose (see the module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        replica_id: str,
        local_fallback: bool,
        timeout_s: float,
        client: httpx.AsyncClient,
        prefill_urls: KnownPrefillURLs,
    ) -> None:
        self.app = app
        self.replica_id = replica_id
        self.local_fallback = local_fallback
        self.timeout_s = timeout_s
        self.client = client
        self.prefill_urls = prefill_urls

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or route_path(scope) not in PREFILL_PATHS:
            await self.app(scope, receive, send)
            return
        raw = await read_body(receive)
        if raw is None:
            return
        try:
            request = json.loads(raw)
        except ValueError:
            request = None
        if not isinstance(request, dict):
            # Not a JSON object: vLLM's own validation answers it, no prefill to run.
            await self._serve(scope, receive, send, raw, [])
            return
        if _header(scope, PREFILL_BY_CALLER_HEADER) is not None:
            PREFILL_REQUESTS.labels("", OUTCOME_BY_CALLER).inc()
            await self._serve(scope, receive, send, raw, [])
            return
        request.pop("kv_transfer_params", None)
        await self._prefill_then_decode(scope, receive, send, request)

    async def _prefill_then_decode(self, scope: Scope, receive: Receive, send: Send, request: dict[str, Any]) -> None:
        prefill_replica = _header(scope, PREFILL_REPLICA_HEADER)
        prefill_url = _header(scope, PREFILL_URL_HEADER)
        disconnect = asyncio.ensure_future(receive())
        prefill = asyncio.ensure_future(self._prefill(scope, request, prefill_replica, prefill_url))
        try:
            await asyncio.wait({disconnect, prefill}, return_when=asyncio.FIRST_COMPLETED)
            if not prefill.done():
                PREFILL_REQUESTS.labels(prefill_replica or "", OUTCOME_CANCELLED).inc()
                return
            try:
                request["kv_transfer_params"] = prefill.result()
            except PrefillRejected as rejected:
                PREFILL_REQUESTS.labels(prefill_replica or "", OUTCOME_REJECTED).inc()
                await self._relay(send, rejected.response, prefill_replica or "")
                return
            except PrefillFailed as failure:
                await self._after_failure(scope, disconnect, send, request, prefill_replica, failure)
                return
            PREFILL_REQUESTS.labels(prefill_replica or "", OUTCOME_REMOTE).inc()
            stamp = [(SERVED_PREFILL_HEADER.encode(), (prefill_replica or "").encode())]
            await self._serve(scope, _after(disconnect), send, json.dumps(request).encode(), stamp)
        finally:
            for task in (prefill, disconnect):
                if not task.done():
                    task.cancel()

    async def _after_failure(
        self,
        scope: Scope,
        disconnect: asyncio.Future,
        send: Send,
        request: dict[str, Any],
        prefill_replica: str | None,
        failure: PrefillFailed,
    ) -> None:
        if not self.local_fallback:
            PREFILL_REQUESTS.labels(prefill_replica or "", OUTCOME_FAILED).inc()
            status = 503 if failure.reason == REASON_PREFILL_UNROUTED else 502
            stamp = [(SERVED_PREFILL_HEADER.encode(), prefill_replica.encode())] if prefill_replica else []
            await send_openai_error(send, status, failure.reason, str(failure), stamp)
            return
        PREFILL_REQUESTS.labels(prefill_replica or "", OUTCOME_LOCAL).inc()
        stamp = [
            (SERVED_PREFILL_HEADER.encode(), self.replica_id.encode()),
            (PREFILL_FALLBACK_HEADER.encode(), failure.reason.encode()),
        ]
        await self._serve(scope, _after(disconnect), send, json.dumps(request).encode(), stamp)

    async def _prefill(
        self, scope: Scope, request: dict[str, Any], prefill_replica: str | None, prefill_url: str | None
    ) -> dict[str, Any]:
        if not prefill_replica or not prefill_url:
            raise PrefillFailed(REASON_PREFILL_UNROUTED, "no prefill replica was chosen for this request")
        if not await self.prefill_urls.known(prefill_replica, prefill_url):
            raise PrefillFailed(REASON_PREFILL_UNROUTED, f"{prefill_replica} is no prefill replica of this model")
        headers = {"content-type": "application/json"}
        # The request id, and its trace (the decode replica's span, when tracing): the prefill joins both.
        for name in (REQUEST_ID_HEADER, TRACEPARENT_HEADER):
            value = _header(scope, name)
            if value is not None:
                headers[name] = value
        try:
            response = await self.client.post(
                prefill_url + route_path(scope),
                content=json.dumps(prefill_body(request)).encode(),
                headers=headers,
                timeout=self.timeout_s,
            )
        except httpx.HTTPError as error:
            detail = f"prefill replica {prefill_replica} failed: {type(error).__name__}"
            raise PrefillFailed(REASON_PREFILL_FAILED, detail) from None
        if 400 <= response.status_code < 500:
            raise PrefillRejected(response)
        params = _kv_transfer_params(response)
        if params is None:
            detail = f"prefill replica {prefill_replica} answered {response.status_code} without KV transfer parameters"
            raise PrefillFailed(REASON_PREFILL_FAILED, detail)
        return params

    async def _relay(self, send: Send, response: httpx.Response, prefill_replica: str) -> None:
        body = response.content
        headers = [
            (b"content-type", response.headers.get("content-type", "application/json").encode()),
            (b"content-length", str(len(body)).encode()),
            (SERVED_PREFILL_HEADER.encode(), prefill_replica.encode()),
        ]
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _serve(self, scope: Scope, receive: Receive, send: Send, body: bytes, stamp: list) -> None:
        """vLLM's app on `body` (already read), the response stamped with `stamp`."""

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start" and stamp:
                message["headers"] = [*message.get("headers", []), *stamp]
            await send(message)

        await call_with_body(self.app, scope, receive, stamped, body)


def _after(disconnect: asyncio.Future) -> Receive:
    """The client's next message: the receive already waiting (a disconnect is final, so it may be read twice).
    Shielded: vLLM cancels its own disconnect listener once a streamed response has started, and that must not
    cancel the shared receive that the streaming response still listens on."""

    async def receive() -> Message:
        return await asyncio.shield(disconnect)

    return receive


def _kv_transfer_params(response: httpx.Response) -> dict[str, Any] | None:
    if response.status_code != 200:
        return None
    try:
        params = response.json().get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None
    return params if isinstance(params, dict) and params else None
