"""A tracing router's decision as a span, `sluice.route`: the child of the route call's `traceparent` (the client's,
which the frontend handed on), or the root of a new trace sampled at the stack's ratio when the request came with
none: the frontend accepts or starts the trace here.

The span holds the policy, the candidates (how many and which), and the pick or the refusal with its reason; its
own `traceparent` goes back in the answer (`RouteReply.traceparent`) and the frontend forwards the request with it, so
the replica's and the engine's spans are its children. Started and ended explicitly, never made current: a decision
that waits resumes in another task (the route agent's), where a context attached before would not detach.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from base.contracts import REQUEST_ID_HEADER
from base.route_wire import RouteReply
from base.tracing import parent_context, traceparent
from routers.core import Decision, ReplicaView

SPAN_NAME = "sluice.route"
# Span attributes (sluice's own namespace).
ATTR_APP = "sluice.app"
ATTR_POLICY = "sluice.policy"
ATTR_REQUEST_ID = "sluice.request_id"
ATTR_CANDIDATES = "sluice.candidates"
ATTR_CANDIDATE_IDS = "sluice.candidate_ids"
ATTR_PICK = "sluice.pick"
ATTR_FALLBACKS = "sluice.fallbacks"
ATTR_REASON = "sluice.reason"
ATTR_REFUSAL = "sluice.refusal"


class RouteSpans:
    """Starts a decision's span and records its outcome, for one router app's policy."""

    def __init__(self, tracer: Tracer, app: str, policy: str) -> None:
        self._tracer = tracer
        self._attributes = {ATTR_APP: app, ATTR_POLICY: policy}

    def start(self, headers: Mapping[str, str]) -> Span:
        """The decision's span, child of the route call's `traceparent` (a new trace's root without one)."""
        attributes = dict(self._attributes)
        request_id = headers.get(REQUEST_ID_HEADER)
        if request_id:
            attributes[ATTR_REQUEST_ID] = request_id
        return self._tracer.start_span(
            SPAN_NAME, context=parent_context(headers), kind=SpanKind.SERVER, attributes=attributes
        )

    @staticmethod
    def picked(span: Span, views: Sequence[ReplicaView], decision: Decision, reply: RouteReply) -> RouteReply:
        """End the span with the candidates, the pick and the policy's reason; the reply with its `traceparent`."""
        span.set_attributes(
            {
                ATTR_CANDIDATES: len(views),
                ATTR_CANDIDATE_IDS: [view.replica_id for view in views],
                ATTR_PICK: reply.replica_id,
                ATTR_FALLBACKS: reply.fallbacks,
                ATTR_REASON: decision.reason,
            }
        )
        span.end()
        return reply.model_copy(update={"traceparent": traceparent(span)})

    @staticmethod
    def refused(span: Span, views: Sequence[ReplicaView] | None, reason: str) -> None:
        """End the span as an error with the refusal's reason (and the candidates, when they were listed)."""
        if views is not None:
            span.set_attributes({ATTR_CANDIDATES: len(views), ATTR_CANDIDATE_IDS: [view.replica_id for view in views]})
        span.set_attribute(ATTR_REFUSAL, reason)
        span.set_status(Status(StatusCode.ERROR, reason))
        span.end()
