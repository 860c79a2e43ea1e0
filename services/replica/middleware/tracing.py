"""ASGI middleware of a tracing replica: each request a span, `sluice.replica.request`, and vLLM's spans its children.

The span is the child of the request's `traceparent` (the router's decision, which the frontend forwarded; or the
client's, on a path without a router decision), or the root of a new trace sampled at the stack's ratio. Its own
`traceparent` replaces the request's before vLLM's app reads it, so the engine's span (`llm_request`, vLLM's tracer
with `--otlp-traces-endpoint`) is its child. A GET or HEAD request without a `traceparent` (health checks, model
lists) is no span. The span ends with the response's last bytes, or when the app fails. Pure ASGI, like every
middleware here.
"""

from __future__ import annotations

from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from base.contracts import REQUEST_ID_HEADER, TRACEPARENT_HEADER
from base.tracing import parent_context, traceparent
from services.replica.middleware.replica_headers import ASGIApp, Message, Receive, Scope, Send

SPAN_NAME = "sluice.replica.request"
ATTR_REPLICA = "sluice.replica"
ATTR_REQUEST_ID = "sluice.request_id"
ATTR_METHOD = "http.request.method"
ATTR_PATH = "url.path"
ATTR_STATUS = "http.response.status_code"
_TRACEPARENT = TRACEPARENT_HEADER.encode()
_UNTRACED_METHODS = ("GET", "HEAD")


class TracingMiddleware:
    """Make each request a span of `tracer` and hand its context to the app in the request's `traceparent`."""

    def __init__(self, app: ASGIApp, tracer: Tracer, replica_id: str) -> None:
        self.app = app
        self.tracer = tracer
        self.replica_id = replica_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if scope["method"] in _UNTRACED_METHODS and TRACEPARENT_HEADER not in headers:
            await self.app(scope, receive, send)
            return
        attributes = {ATTR_REPLICA: self.replica_id, ATTR_METHOD: scope["method"], ATTR_PATH: scope["path"]}
        if REQUEST_ID_HEADER in headers:
            attributes[ATTR_REQUEST_ID] = headers[REQUEST_ID_HEADER]
        span = self.tracer.start_span(
            SPAN_NAME, context=parent_context(headers), kind=SpanKind.SERVER, attributes=attributes
        )
        own = traceparent(span)
        kept = [(k, v) for k, v in scope["headers"] if k.lower() != _TRACEPARENT]
        scope["headers"] = [*kept, (_TRACEPARENT, own.encode())] if own is not None else kept

        ended = False

        async def send_ending_span(message: Message) -> None:
            nonlocal ended
            if message["type"] == "http.response.start":
                status = int(message["status"])
                span.set_attribute(ATTR_STATUS, status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False) and not ended:
                ended = True
                span.end()

        try:
            await self.app(scope, receive, send_ending_span)
        except BaseException as error:
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, type(error).__name__))
            raise
        finally:
            if not ended:
                span.end()
