"""Traces across the path on the real one: a real HAProxy, a real router (its route agent, SPOE) and the session's
tiny vLLM replicas, all tracing to an in-test OTLP/gRPC receiver on loopback. A request that comes with a sampled
`traceparent` is one trace: the router's decision is its child, the replica's request the decision's child, and
vLLM's own span the replica's; a request with none starts its trace at the router. And the HTTP route call (a
router without a route agent): a stand-in router and replica behind a tracing HAProxy show what the frontend sends
and forwards.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import httpx
import pytest

from base.contracts import TRACEPARENT_HEADER
from base.tracing import ENGINE_SERVICE, REPLICA_SERVICE, ROUTER_SERVICE, Tracing
from base.waiting import wait_until
from infra.haproxy.apps import AppRoute
from services.replica.middleware.tracing import SPAN_NAME as REPLICA_SPAN
from services.router.route_span import SPAN_NAME as ROUTE_SPAN
from tests.integration.standin_plane.plane import start_plane, stop_plane
from tests.integration.standin_plane.standins import (
    APP,
    LoopThread,
    ReplicaStandIn,
    RouterBehavior,
    RouterStandIn,
    StandIn,
)
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


def _sampled_traceparent() -> str:
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


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


def test_the_http_route_call_hands_the_traceparent_on_and_forwards_the_router_s(tmp_path: Path) -> None:
    client, router = _sampled_traceparent(), _sampled_traceparent()
    loop = LoopThread()
    behavior = RouterBehavior(replica_ids=["r1"], traceparent=router)
    replica, router_stand_in = ReplicaStandIn("r1"), RouterStandIn("router-a", behavior)
    started: list[StandIn] = []
    plane = None
    try:
        for stand_in in (replica, router_stand_in):
            loop.run(stand_in.start())
            started.append(stand_in)
        plane = start_plane(
            loop, tmp_path, AppRoute(name=APP), [replica.endpoint], [router_stand_in.endpoint], tracing=True
        )
        for sent, forwarded in ((client, router), (None, router)):
            headers = {TRACEPARENT_HEADER: sent} if sent is not None else {}
            response = httpx.post(
                f"{plane.url}/v1/completions", json={"model": "stand-in"}, headers=headers, timeout=10
            )
            assert response.status_code == 200, response.text
            assert behavior.calls[-1][1].header(TRACEPARENT_HEADER) == sent
            assert replica.requests[-1].header(TRACEPARENT_HEADER) == forwarded
        # A router that answers none (tracing off there) leaves the client's as it came.
        behavior.traceparent = None
        response = httpx.post(f"{plane.url}/v1/completions", json={}, headers={TRACEPARENT_HEADER: client}, timeout=10)
        assert response.status_code == 200 and replica.requests[-1].header(TRACEPARENT_HEADER) == client
    finally:
        if plane is not None:
            stop_plane(plane)
        for stand_in in started:
            loop.run(stand_in.stop())
        loop.close()
