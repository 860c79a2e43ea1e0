"""The router's HTTP app: the route call, the route table, membership, the route agent's port, the fault switch,
/metrics, and the running policy's own report; each path is described in services/router/README.md.

A route call is answered by one function (`app.state.answer_route`) that the route agent calls too: the asking
frontend's membership narrows the replicas, the prefill side (if any) picks the prefill replica, the policy decides.
What the app does for a particular policy (its report's path, the gauges it refreshes) it asks the policy's registry
entry: no policy class is named here.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request, Response
from opentelemetry.trace import Span
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from pydantic import ValidationError

from base.agent_wire import Answer
from base.contracts import (
    FAULT_PATH,
    FRONTEND_HEADER,
    MEMBERSHIP_PATH,
    REASON_INJECTED_FAULT,
    REASON_ROUTER_ERROR,
    ROUTE_PATH,
    ROUTE_TABLE_PATH,
)
from base.route_wire import Membership, RouteRefusal, RouteReply
from infra.observability.targets import METRICS_PATH
from routers.core import Decision, NoReplicaAvailable, ReplicaView, RouteRequest, RoutingPolicy
from routers.registry import policy_entry, table_of
from services.router.fault import InjectedFault
from services.router.membership import FrontendMembership
from services.router.prefill_side import PrefillChooser, PrefillPick
from services.router.route_listener import ROUTE_LISTENER_PATH
from services.router.route_request import route_request_from
from services.router.route_span import RouteSpans
from services.router.route_table import table_answer
from services.router.settings import RouterSettings

_JSON = "application/json"

ROUTED_TOTAL = Counter("sluice_router_routed", "Route calls answered with a replica.", ["app", "policy"])
REFUSED_TOTAL = Counter("sluice_router_refused", "Route calls refused (503) by reason.", ["app", "policy", "reason"])
TRUNCATED_TOTAL = Counter(
    "sluice_router_truncated_bodies", "Route calls whose forwarded body was cut at the buffer limit.", ["app"]
)
MEMBERSHIP_UPDATES_TOTAL = Counter(
    "sluice_router_membership_updates", "Frontend membership publications accepted (heartbeats included).", ["app"]
)


def route_reply(decision: Decision, prefill: PrefillPick | None = None) -> RouteReply:
    ranked = decision.ranked_ids
    return RouteReply(
        replica_id=ranked[0],
        fallbacks=list(ranked[1:]),
        capacity_token=decision.token.token_id if decision.token is not None else None,
        prefill_replica_id=prefill.replica_id if prefill is not None else None,
        prefill_url=prefill.url if prefill is not None else None,
    )


def refused(span: Span | None, views: Sequence[ReplicaView] | None, status: int, reason: str) -> tuple[int, Answer]:
    """A refusal's status and answer, its span (if traced) ended with the reason."""
    if span is not None:
        RouteSpans.refused(span, views, reason)
    return status, RouteRefusal(reason=reason)


def build_router_app(
    settings: RouterSettings,
    policy: RoutingPolicy,
    replicas: Callable[[], Sequence[ReplicaView]],
    prefill: PrefillChooser | None = None,
    after_decision: Callable[[Sequence[ReplicaView], RouteRequest, Decision], None] | None = None,
    refresh_metrics: Callable[[], None] | None = None,
    spans: RouteSpans | None = None,
) -> FastAPI:
    """The router's HTTP app; `replicas()` gives the current views of the target app's replicas, which
    each route call narrows to those its frontend published (`FrontendMembership`). With `prefill`, every reply
    also names the prefill replica; `after_decision(views, request, decision)` is called once each answer is out;
    `refresh_metrics()` before /metrics is read (the shadows' gauges); with `spans`, each decision is a span."""
    app = FastAPI(title="sluice router", openapi_url=None, docs_url=None, redoc_url=None)
    routed = ROUTED_TOTAL.labels(settings.target_app, policy.name)
    truncated_bodies = TRUNCATED_TOTAL.labels(settings.target_app)
    membership_updates = MEMBERSHIP_UPDATES_TOTAL.labels(settings.target_app)
    membership = FrontendMembership()
    fault = InjectedFault()

    async def answer(headers: Mapping[str, str], body: bytes) -> tuple[int, Answer]:
        """A route call's status and answer (the route endpoint's, as JSON, and the route agent's, as variables)."""
        span = spans.start(headers) if spans is not None else None
        if fault.active():
            return refused(span, None, 500, REASON_INJECTED_FAULT)
        route_request = route_request_from(headers, body, settings.session_header)
        if route_request.body_truncated:
            truncated_bodies.inc()
        frontend = headers.get(FRONTEND_HEADER) or None
        views: Sequence[ReplicaView] | None = None
        try:
            prefill_replica = prefill.choose(route_request) if prefill is not None else None
            views = membership.routable(replicas(), frontend)
            decision = await policy.decide(views, route_request)
        except NoReplicaAvailable as refusal:
            REFUSED_TOTAL.labels(settings.target_app, policy.name, refusal.reason).inc()
            return refused(span, views, 503, refusal.reason)
        except BaseException:  # a failed or cancelled decision: its span still ends
            if span is not None:
                RouteSpans.refused(span, views, REASON_ROUTER_ERROR)
            raise
        routed.inc()
        if after_decision is not None:
            # After the answer is on its way: what follows the decision (the shadows) never delays it.
            asyncio.get_running_loop().call_soon(after_decision, views, route_request, decision)
        reply = route_reply(decision, prefill_replica)
        return 200, reply if span is None else RouteSpans.picked(span, views, decision, reply)

    app.state.answer_route = answer
    app.state.route_listener_port = None

    @app.post(ROUTE_PATH)
    async def route(request: Request) -> Response:
        status, answered = await answer(request.headers, await request.body())
        reply = answered.wire_json() if isinstance(answered, RouteReply) else answered.model_dump_json()
        return Response(reply, status_code=status, media_type=_JSON)

    # A prefill/decode router pairs each request with a prefill replica: no table can say that.
    table_rule = table_of(settings.policy, settings.policy_kwargs) if prefill is None else None

    @app.get(ROUTE_TABLE_PATH)
    async def route_table(request: Request) -> Response:
        views = membership.routable(replicas(), request.headers.get(FRONTEND_HEADER) or None)
        status, table = table_answer(table_rule, views, fault.active())
        return Response(table.model_dump_json(), status_code=status, media_type=_JSON)

    @app.get(ROUTE_LISTENER_PATH)
    async def route_listener() -> Response:
        port = app.state.route_listener_port
        if port is None:
            return Response('{"detail": "no route listener"}', status_code=404, media_type=_JSON)
        return Response(json.dumps({"port": port}), media_type=_JSON)

    entry = policy_entry(settings.policy)
    if entry.report is not None:
        report = entry.report

        @app.get(report.path)
        async def policy_report() -> dict[str, Any]:
            return report.build(policy)

    @app.post(MEMBERSHIP_PATH)
    async def publish_membership(request: Request) -> Response:
        try:
            published = Membership.model_validate_json(await request.body())
        except ValidationError as error:
            # Invalid JSON is a ValidationError too; the context may hold exceptions, which json cannot dump.
            detail = error.errors(include_url=False, include_input=False, include_context=False)
            return Response(json.dumps({"detail": detail}), status_code=422, media_type=_JSON)
        if membership.publish(published):
            policy.tracker.sampled()
        membership_updates.inc()
        return Response(status_code=204)

    if settings.fault_injection:

        @app.post(FAULT_PATH)
        async def inject_fault(request: Request) -> Response:
            try:
                fault.arm(InjectedFault.Request.model_validate_json(await request.body()).seconds)
            except ValidationError as error:
                return Response(error.json(include_url=False), status_code=422, media_type=_JSON)
            return Response(status_code=204)

    @app.get(METRICS_PATH)
    async def metrics() -> Response:
        if entry.refresh_metrics is not None:
            await entry.refresh_metrics(policy, settings.target_app)
        if refresh_metrics is not None:
            refresh_metrics()
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
