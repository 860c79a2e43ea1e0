"""Traces across the path on the real one: a real HAProxy, a real router (its route agent, SPOE) and the session's
tiny vLLM replicas, all tracing to an in-test OTLP/gRPC receiver on loopback. A request that comes with a sampled
`traceparent` is one trace: the router's decision is its child, the replica's request the decision's child, and
vLLM's own span the replica's; a request with none starts its trace at the router.
"""

from __future__ import annotations

import secrets

import httpx
import pytest

from base.contracts import TRACEPARENT_HEADER
from base.tracing import ENGINE_SERVICE, REPLICA_SERVICE, ROUTER_SERVICE, Tracing
from base.waiting import wait_until
from services.replica.middleware.tracing import SPAN_NAME as REPLICA_SPAN
from services.router.route_span import SPAN_NAME as ROUTE_SPAN
from tests.support.llm_cluster import LLMCluster, direct_stack
from tests.support.otlp_receiver import OTLPReceiver, ReceivedSpan

pytestmark = pytest.mark.integration

COMPLETION = {"model": "sluice-tiny", "prompt": "ka lo", "max_tokens": 4, "ignore_eos": True}
# vLLM's span of a request, made when the request finishes (its output processor).
ENGINE_SPAN = "llm_request"
# Spans reach the receiver within `base.tracing.EXPORT_DELAY_S` of their end; this bounds the wait with room.
SPANS_TIMEOUT_S = 30.0


# The span each service makes of a request.
HOPS = {ROUTER_SERVICE: ROUTE_SPAN, REPLICA_SERVICE: REPLICA_SPAN, ENGINE_SERVICE: ENGINE_SPAN}


def _hops(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    """Each hop's span among a trace's, by its service."""
    return {span.service: span for span in spans if HOPS.get(span.service) == span.name}


def _complete(spans: list[ReceivedSpan]) -> bool:
    return _hops(spans).keys() == HOPS.keys()


def test_one_request_is_one_trace_from_the_router_through_the_replica_into_vllm(
    llm_cluster: LLMCluster, otlp_traces: OTLPReceiver
) -> None:
    # The router starts a trace for every request without one (ratio 1); the replicas (ratio 0) follow their parent.
    tracing = Tracing(otlp_endpoint=otlp_traces.endpoint, sample_ratio=1.0)
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    with direct_stack(llm_cluster, tracing=tracing) as stack:
        headers = {TRACEPARENT_HEADER: f"00-{trace_id}-{client_span}-01"}
        response = httpx.post(f"{stack.url}/v1/completions", json=COMPLETION, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        wait_until(
            SPANS_TIMEOUT_S, lambda: _complete(otlp_traces.trace(trace_id)), "the router's, replica's and vLLM's spans"
        )
        spans = otlp_traces.trace(trace_id)
        assert len(spans) >= 3 and len({span.service for span in spans}) >= 2
        hops = _hops(spans)
        route, replica, engine = hops[ROUTER_SERVICE], hops[REPLICA_SERVICE], hops[ENGINE_SERVICE]
        # Each hop the child of the one before: the client's span, the decision, the replica's request, vLLM's.
        assert route.parent_span_id == client_span
        assert replica.parent_span_id == route.span_id
        assert engine.parent_span_id == replica.span_id

        # No traceparent: the router starts the trace, and the replica and vLLM join it.
        known = {span.trace_id for span in otlp_traces.spans()}
        response = httpx.post(f"{stack.url}/v1/completions", json=COMPLETION, timeout=60)
        assert response.status_code == 200, response.text

        def started() -> list[ReceivedSpan]:
            roots = [s for s in otlp_traces.spans() if s.trace_id not in known and s.service == ROUTER_SERVICE]
            return otlp_traces.trace(roots[0].trace_id) if roots else []

        wait_until(SPANS_TIMEOUT_S, lambda: _complete(started()), "a trace the router started")
        hops = _hops(started())
        assert hops[ROUTER_SERVICE].parent_span_id == ""
        assert hops[REPLICA_SERVICE].parent_span_id == hops[ROUTER_SERVICE].span_id
        assert hops[ENGINE_SERVICE].parent_span_id == hops[REPLICA_SERVICE].span_id
