"""The decode replica's prefill phase (services.replica.middleware.remote_prefill) against a recording inner app and a
prefill replica
answered by httpx's MockTransport: what the prefill call sends, what decode gets, each failure and its answer.
The real path (vLLM engines, NIXL) is tested end to end in tests/integration/prefill_decode/test_transfer.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from base.contracts import (
    PREFILL_BY_CALLER_HEADER,
    PREFILL_FALLBACK_HEADER,
    PREFILL_REPLICA_HEADER,
    PREFILL_URL_HEADER,
    REASON_PREFILL_FAILED,
    REASON_PREFILL_UNROUTED,
    REQUEST_ID_HEADER,
    SERVE_REASON_HEADER,
    SERVED_PREFILL_HEADER,
    TRACEPARENT_HEADER,
)
from services.replica.asgi_call import route_path
from services.replica.middleware.remote_prefill import REMOTE_DECODE_PARAMS, RemotePrefillMiddleware, prefill_body
from services.replica.prefill_endpoints import KnownPrefillURLs
from services.serve_internals import ReplicaEndpoint

PREFILL_URL = "http://127.0.0.1:30007/tiny-prefill"
# The prefill app's replicas as Serve lists them: p7 serves at PREFILL_URL.
PREFILL_ENDPOINTS = [ReplicaEndpoint(replica_id="p7", deployment="LLMReplica", host="127.0.0.1", port=30007)]
TRANSFER = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [3, 4], "remote_port": 5600}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 8}


class InnerApp:
    """vLLM's app in these tests: records the body it got and answers 200."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        message = await receive()
        self.bodies.append(json.loads(message["body"]))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"decoded", "more_body": False})


class PrefillReplica:
    """The prefill replica's HTTP answers; records each request."""

    def __init__(self, status: int = 200, params: dict[str, Any] | None = TRANSFER, error: bool = False) -> None:
        self.status, self.params, self.error = status, params, error
        self.requests: list[httpx.Request] = []
        self.hang = False
        self.cancelled = asyncio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.error:
            raise httpx.ConnectError("connection refused", request=request)
        if self.hang:
            try:
                await asyncio.Event().wait()
            finally:
                self.cancelled.set()
        body = {"choices": [{"text": "x"}], "kv_transfer_params": self.params}
        if self.status != 200:
            body = {"error": {"message": "prompt too long", "code": self.status}}
        return httpx.Response(self.status, json=body)


ROUTED = {PREFILL_REPLICA_HEADER: "p7", PREFILL_URL_HEADER: PREFILL_URL, REQUEST_ID_HEADER: "req-1"}


async def drive(
    app: Any,
    prefill: PrefillReplica,
    body: bytes | dict[str, Any] = CHAT,
    headers: dict[str, str] = ROUTED,
    local_fallback: bool = False,
    path: str = "/tiny-llm/v1/chat/completions",
    method: str = "POST",
    disconnect_after_s: float | None = None,
) -> list[dict[str, Any]]:
    """One request through the middleware in front of `app`: the messages it sent. The client sends the body,
    then disconnects after `disconnect_after_s` (or never)."""
    client = httpx.AsyncClient(transport=httpx.MockTransport(prefill))

    async def endpoints() -> list[ReplicaEndpoint]:
        return PREFILL_ENDPOINTS

    known = KnownPrefillURLs("tiny-prefill", endpoints)
    middleware = RemotePrefillMiddleware(app, "d1", local_fallback, timeout_s=5.0, client=client, prefill_urls=known)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "root_path": "/tiny-llm",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        if disconnect_after_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(disconnect_after_s or 0)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    try:
        await asyncio.wait_for(middleware(scope, receive, send), timeout=5)
    finally:
        await client.aclose()
    return sent


def call(prefill: PrefillReplica, body: bytes | dict[str, Any] = CHAT, headers: dict[str, str] = ROUTED, **kwargs: Any):
    """(status, response headers, body, the inner app) of one request to a recording inner app."""
    inner = InnerApp()
    sent = asyncio.run(drive(inner, prefill, body, headers, **kwargs))
    response_headers = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
    return sent[0]["status"], response_headers, b"".join(m.get("body", b"") for m in sent[1:]), inner


def test_the_prefill_request_asks_one_token_for_a_remote_decode_and_keeps_the_rest() -> None:
    body = prefill_body({**CHAT, "stream_options": {"include_usage": True}, "min_tokens": 4, "temperature": 0})
    assert body["max_tokens"] == 1 and body["stream"] is False
    assert body["kv_transfer_params"] == REMOTE_DECODE_PARAMS
    assert "stream_options" not in body and "min_tokens" not in body
    assert body["messages"] == CHAT["messages"] and body["temperature"] == 0
    assert prefill_body({**CHAT, "max_completion_tokens": 50}).get("max_completion_tokens") is None


def test_route_path_is_below_the_app_prefix() -> None:
    assert route_path({"path": "/tiny-llm/v1/completions", "root_path": "/tiny-llm"}) == "/v1/completions"
    assert route_path({"path": "/v1/completions", "root_path": ""}) == "/v1/completions"


def test_decode_gets_the_prefill_transfer_params_and_the_response_names_the_prefill_replica() -> None:
    prefill = PrefillReplica()
    client_params = {"remote_host": "10.0.0.1", "remote_port": 1}
    status, headers, body, inner = call(prefill, {**CHAT, "kv_transfer_params": client_params})
    assert (status, body) == (200, b"decoded")
    assert headers[SERVED_PREFILL_HEADER] == "p7" and PREFILL_FALLBACK_HEADER not in headers
    [sent] = prefill.requests
    assert str(sent.url) == PREFILL_URL + "/v1/chat/completions"
    assert sent.headers[REQUEST_ID_HEADER] == "req-1"
    assert json.loads(sent.content) == prefill_body(CHAT)
    # Decode: the client's body, its own kv_transfer_params replaced by the prefill's.
    assert inner.bodies == [{**CHAT, "kv_transfer_params": TRANSFER}]


def test_an_unreachable_prefill_replica_is_a_clear_502_and_decode_never_runs() -> None:
    status, headers, body, inner = call(PrefillReplica(error=True))
    assert status == 502 and headers[SERVE_REASON_HEADER] == REASON_PREFILL_FAILED
    error = json.loads(body)["error"]
    assert "p7" in error["message"] and error["code"] == 502 and error["type"] == "server_error"
    assert inner.bodies == []


def test_a_prefill_answer_without_transfer_params_fails_the_same_way() -> None:
    for prefill in (PrefillReplica(params=None), PrefillReplica(status=500)):
        status, headers, _, inner = call(prefill)
        assert status == 502 and headers[SERVE_REASON_HEADER] == REASON_PREFILL_FAILED and inner.bodies == []


def test_a_request_with_no_prefill_replica_chosen_is_a_503() -> None:
    prefill = PrefillReplica()
    status, headers, body, inner = call(prefill, headers={})
    assert status == 503 and headers[SERVE_REASON_HEADER] == REASON_PREFILL_UNROUTED
    assert json.loads(body)["error"]["type"] == "service_unavailable"
    assert prefill.requests == [] and inner.bodies == []


def test_local_fallback_prefills_here_and_says_why() -> None:
    for prefill, headers, reason in (
        (PrefillReplica(error=True), ROUTED, REASON_PREFILL_FAILED),
        (PrefillReplica(), {}, REASON_PREFILL_UNROUTED),
    ):
        status, response_headers, _, inner = call(
            prefill, {**CHAT, "kv_transfer_params": TRANSFER}, headers, local_fallback=True
        )
        assert status == 200
        assert response_headers[PREFILL_FALLBACK_HEADER] == reason
        assert response_headers[SERVED_PREFILL_HEADER] == "d1"
        # Served whole here: no transfer parameters, not even the client's.
        assert inner.bodies == [CHAT]


def test_a_prefill_refusal_of_the_request_goes_back_to_the_client_as_it_came() -> None:
    status, headers, body, inner = call(PrefillReplica(status=400), local_fallback=True)
    assert status == 400 and json.loads(body)["error"]["message"] == "prompt too long"
    assert headers[SERVED_PREFILL_HEADER] == "p7" and inner.bodies == []


def test_an_internal_caller_that_ran_the_prefill_passes_its_own_params() -> None:
    prefill = PrefillReplica()
    body = {**CHAT, "kv_transfer_params": TRANSFER}
    status, _, _, inner = call(prefill, body, {PREFILL_BY_CALLER_HEADER: "1"})
    assert status == 200 and inner.bodies == [body] and prefill.requests == []


def test_other_requests_pass_through_untouched() -> None:
    prefill = PrefillReplica()
    for path, method in (("/tiny-llm/v1/models", "POST"), ("/tiny-llm/v1/chat/completions", "PUT")):
        status, _, _, inner = call(prefill, CHAT, path=path, method=method)
        assert status == 200 and inner.bodies == [CHAT]
    # A body that is not a JSON object is vLLM's to refuse.
    status, _, _, inner = call(prefill, b"[1, 2]")
    assert status == 200 and inner.bodies == [[1, 2]]
    assert prefill.requests == []


def test_a_client_disconnect_during_prefill_cancels_the_prefill_call() -> None:
    prefill = PrefillReplica()
    prefill.hang = True
    inner = InnerApp()
    sent = asyncio.run(drive(inner, prefill, local_fallback=True, disconnect_after_s=0.1))
    assert len(prefill.requests) == 1 and prefill.cancelled.is_set()
    assert sent == [] and inner.bodies == []


def test_a_listener_cancelled_by_the_app_does_not_cancel_the_next_ones_receive() -> None:
    """vLLM's app cancels its disconnect listener once a stream starts; the streaming response listens next."""
    outcome: list[str] = []

    async def streaming_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        first = asyncio.ensure_future(receive())
        await asyncio.sleep(0.01)
        first.cancel()
        try:
            await asyncio.wait_for(receive(), timeout=0.2)
        except asyncio.CancelledError:
            outcome.append("cancelled")
        except TimeoutError:
            outcome.append("still listening")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    asyncio.run(drive(streaming_app, PrefillReplica()))
    assert outcome == ["still listening"]


def test_a_prefill_url_that_is_no_prefill_replicas_is_never_called() -> None:
    """A request on the decode replica's own port with a forged prefill URL (past the frontend, which strips the
    header from clients): nothing is sent there; 503 `prefill_unrouted`, or a local prefill where the model allows."""
    for forged in (
        {**ROUTED, PREFILL_URL_HEADER: "http://169.254.169.254/latest"},
        {**ROUTED, PREFILL_REPLICA_HEADER: "p9"},
    ):
        prefill = PrefillReplica()
        status, headers, _, inner = call(prefill, headers=forged)
        assert status == 503 and headers[SERVE_REASON_HEADER] == REASON_PREFILL_UNROUTED and not inner.bodies
        assert prefill.requests == []
        status, headers, _, inner = call(prefill, headers=forged, local_fallback=True)
        assert status == 200 and headers[PREFILL_FALLBACK_HEADER] == REASON_PREFILL_UNROUTED and prefill.requests == []


def test_a_new_prefill_replica_is_known_after_one_look_up_and_look_ups_are_spaced() -> None:
    listed: list[list[ReplicaEndpoint]] = [PREFILL_ENDPOINTS]
    looked_up = []
    now = [100.0]

    async def endpoints() -> list[ReplicaEndpoint]:
        looked_up.append(now[0])
        return listed[-1]

    async def run() -> list[bool]:
        known = KnownPrefillURLs("tiny-prefill", endpoints, clock=lambda: now[0])
        seen = [await known.known("p7", PREFILL_URL), await known.known("p7", PREFILL_URL)]
        listed.append([*PREFILL_ENDPOINTS, ReplicaEndpoint(replica_id="p8", deployment="d", host="127.0.0.2", port=1)])
        seen.append(await known.known("p8", "http://127.0.0.2:1/tiny-prefill"))  # within a second: not asked again
        now[0] += 1.5
        seen.append(await known.known("p8", "http://127.0.0.2:1/tiny-prefill"))
        seen.append(await known.known("p8", "http://127.0.0.2:1/elsewhere"))
        return seen

    assert asyncio.run(run()) == [True, True, False, True, False]
    assert looked_up == [100.0, 101.5]


def test_the_prefill_call_carries_the_decode_requests_trace() -> None:
    prefill = PrefillReplica()
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    status, _, _, _ = call(prefill, headers={**ROUTED, TRACEPARENT_HEADER: traceparent})
    assert status == 200 and prefill.requests[0].headers[TRACEPARENT_HEADER] == traceparent
    call(untraced := PrefillReplica())
    assert TRACEPARENT_HEADER not in untraced.requests[0].headers, "no trace: none made up"
