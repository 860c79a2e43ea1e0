"""The router service: the control plane of the direct-streaming path (docs/design.md §1, §3).

HAProxy asks which replica of the target app should serve a request (an SPOE message to the replica's route agent,
or `POST /internal/route` on this app); the router answers a `RouteReply` (primary, fallbacks, capacity token, and for
prefill/decode the prefill replica) or a 503 `RouteRefusal` with a reason. It decides only: the request and its
tokens go from HAProxy straight to the chosen replica. `RouterReplica` is the Serve deployment; its candidates are
Serve's endpoint list, narrowed per frontend. What it talks to, and why each interval: services/router/README.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter as Tally
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray
from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, generate_latest
from pydantic import BaseModel, Field, ValidationError
from ray import serve
from ray.serve.deployment import Application

from base.agent_wire import Answer
from base.contracts import (
    FAULT_PATH,
    FRONTEND_HEADER,
    MEMBERSHIP_PATH,
    REASON_INJECTED_FAULT,
    REASON_NO_PREFILL_REPLICA,
    ROUTE_PATH,
    ROUTE_TABLE_PATH,
    NodeRole,
    node_role_resources,
)
from base.rollout import config_version
from base.route_wire import Membership, RouteRefusal, RouteReply
from infra.observability.targets import METRICS_PATH
from routers.capacity_queue import CapacityQueue
from routers.core import Decision, NoReplicaAvailable, ReplicaView, RouteRequest, RoutingPolicy
from routers.kv_aware import KVAware, ReplicaEvents
from routers.metrics import LEDGER_METRICS
from routers.registry import table_of
from services.internal_credential import InternalCredentialMiddleware, internal_credential, internal_headers
from services.router.kv_subscriber import KVEventSubscriber
from services.router.live_replicas import LiveReplicas
from services.router.membership import FrontendMembership
from services.router.route_listener import ROUTE_LISTENER_PATH, RouteListener
from services.router.route_request import route_request_from
from services.router.route_table import table_answer
from services.router.settings import RouterAppArgs, RouterSettings, build_policy, build_prefill_policy
from services.serve_internals import REPLICA_LOGGER, list_replica_endpoints, with_rollout_version

logger = logging.getLogger(REPLICA_LOGGER)

ROUTER_DEPLOYMENT_NAME = "Router"
# A kv_aware router's view of the replicas' KV caches (`kv_index_report`), for operators and tests.
KV_INDEX_PATH = "/internal/kv-index"
# Serve counts route calls against this. A decision takes about a millisecond, but a call of a capacity-metered
# policy may wait up to its `max_wait_s`; Serve's default of 5 would queue every call behind 5 waiters.
ROUTER_MAX_ONGOING_REQUESTS = 1024
_JSON = "application/json"


ROUTED_TOTAL = Counter("sluice_router_routed", "Route calls answered with a replica.", ["app", "policy"])
REFUSED_TOTAL = Counter("sluice_router_refused", "Route calls refused (503) by reason.", ["app", "policy", "reason"])
TRUNCATED_TOTAL = Counter(
    "sluice_router_truncated_bodies", "Route calls whose forwarded body was cut at the buffer limit.", ["app"]
)
KV_REPLICAS = Gauge(
    "sluice_router_kv_replicas",
    "A kv_aware router's target replicas by where their scores come from (events, approximate, lost).",
    ["app", "source"],
)
MEMBERSHIP_UPDATES_TOTAL = Counter(
    "sluice_router_membership_updates", "Frontend membership publications accepted (heartbeats included).", ["app"]
)


class PrefillPick(BaseModel):
    """The prefill replica of a request, and the URL its app is served at (its port and the app's route prefix)."""

    replica_id: str
    url: str


def route_reply(decision: Decision, prefill: PrefillPick | None = None) -> RouteReply:
    ranked = decision.ranked_ids
    return RouteReply(
        replica_id=ranked[0],
        fallbacks=list(ranked[1:]),
        capacity_token=decision.token.token_id if decision.token is not None else None,
        prefill_replica_id=prefill.replica_id if prefill is not None else None,
        prefill_url=prefill.url if prefill is not None else None,
    )


class PrefillChooser:
    """The prefill side of a prefill/decode router: its own policy over the prefill app's replicas."""

    def __init__(
        self,
        policy: RoutingPolicy,
        replicas: Callable[[], Sequence[ReplicaView]],
        route_prefix: str,
        required: bool = True,
    ) -> None:
        self.policy = policy
        self._replicas = replicas
        self._route_prefix = route_prefix
        self._required = required

    def choose(self, request: RouteRequest) -> PrefillPick | None:
        """The prefill replica, or None when there is none and the decode side may prefill locally."""
        try:
            view = self.policy.rank(self._replicas(), request)[0][0]
        except NoReplicaAvailable:
            if not self._required:
                return None
            raise NoReplicaAvailable(REASON_NO_PREFILL_REPLICA) from None
        return PrefillPick(replica_id=view.replica_id, url=view.endpoint + self._route_prefix)


def kv_index_report(policy: KVAware) -> dict[str, Any]:
    """Where each replica's scores come from (`events`, `approximate`, `lost`), its indexed blocks, and the decisions
    by reason."""
    return {
        "block_size": policy.block_size,
        "replicas": {
            view_id: {"source": str(source), "blocks": policy.index.blocks(view_id)}
            for view_id, source in sorted(policy.sources.items())
        },
        "decisions": dict(policy.counts.decisions),
    }


class InjectedFault:
    """A staging router made to fail: every route call until `until` answers 500 `injected_fault`."""

    class Request(BaseModel):
        seconds: float = Field(ge=0, le=3600)

    def __init__(self) -> None:
        self.until = 0.0

    def arm(self, seconds: float) -> None:
        self.until = time.monotonic() + seconds

    def active(self) -> bool:
        return time.monotonic() < self.until


def build_router_app(
    settings: RouterSettings,
    policy: RoutingPolicy,
    replicas: Callable[[], Sequence[ReplicaView]],
    prefill: PrefillChooser | None = None,
) -> FastAPI:
    """The router's HTTP app; `replicas()` gives the current views of the target app's replicas, which
    each route call narrows to those its frontend published (`FrontendMembership`). With `prefill`, every reply
    also names the prefill replica."""
    app = FastAPI(title="sluice router", openapi_url=None, docs_url=None, redoc_url=None)
    routed = ROUTED_TOTAL.labels(settings.target_app, policy.name)
    truncated_bodies = TRUNCATED_TOTAL.labels(settings.target_app)
    membership_updates = MEMBERSHIP_UPDATES_TOTAL.labels(settings.target_app)
    membership = FrontendMembership()
    fault = InjectedFault()

    async def answer(headers: Mapping[str, str], body: bytes) -> tuple[int, Answer]:
        """A route call's status and answer (the route endpoint's, as JSON, and the route agent's, as variables)."""
        if fault.active():
            return 500, RouteRefusal(reason=REASON_INJECTED_FAULT)
        route_request = route_request_from(headers, body, settings.session_header)
        if route_request.body_truncated:
            truncated_bodies.inc()
        frontend = headers.get(FRONTEND_HEADER) or None
        try:
            prefill_replica = prefill.choose(route_request) if prefill is not None else None
            decision = await policy.decide(membership.routable(replicas(), frontend), route_request)
        except NoReplicaAvailable as refusal:
            REFUSED_TOTAL.labels(settings.target_app, policy.name, refusal.reason).inc()
            return 503, RouteRefusal(reason=refusal.reason)
        routed.inc()
        return 200, route_reply(decision, prefill_replica)

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

    if isinstance(policy, KVAware):

        @app.get(KV_INDEX_PATH)
        async def kv_index() -> dict[str, Any]:
            return kv_index_report(policy)

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
        if isinstance(policy, CapacityQueue):
            LEDGER_METRICS.update(settings.target_app, await policy.ledger_snapshot())
        if isinstance(policy, KVAware):
            counted = Tally(policy.sources.values())
            for source in ReplicaEvents:
                KV_REPLICAS.labels(settings.target_app, str(source)).set(counted[source])
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


@serve.ingress()
class RouterReplica:
    async def __init__(self, settings: dict[str, Any]) -> None:
        self._settings = RouterSettings.model_validate(settings)
        self._policy = policy = build_policy(self._settings)
        self._replicas = self._live_replicas(
            self._settings.target_app, self._settings.target_capacity, self._settings.data_parallel_size
        )
        await self._replicas.start()
        self._kv_events: KVEventSubscriber | None = None
        if isinstance(policy, KVAware):
            self._kv_events = KVEventSubscriber(
                policy,
                self._settings.target_route_prefix,
                self._settings.data_parallel_size,
                headers=internal_headers(),
            )
            await self._kv_events.sync(self._replicas.views())
            self._kv_sync = asyncio.get_running_loop().create_task(self._follow_kv_events(self._kv_events))
        prefill = None
        if self._settings.prefill is not None:
            side = self._settings.prefill
            prefill_policy = build_prefill_policy(self._settings, side)
            self._prefill_replicas = self._live_replicas(side.app, side.capacity)
            await self._prefill_replicas.start()
            prefill = PrefillChooser(prefill_policy, self._prefill_replicas.views, side.route_prefix, side.required)
        self._app = build_router_app(self._settings, policy, self._replicas.views, prefill)
        # Route calls, membership and tables come from the frontend's HAProxy and replica; nobody else's count.
        self._app.add_middleware(InternalCredentialMiddleware, credential=internal_credential())
        self._listener = RouteListener(
            self._app.state.answer_route, self._settings.session_header, self._settings.agent_deadline_s
        )
        self._app.state.route_listener_port = await self._listener.start(ray.util.get_node_ip_address())

    def _live_replicas(self, app: str, capacity: int, ranks: int = 1) -> LiveReplicas:
        # An app whose replicas run but list no endpoint was started by a Serve without direct ingress.
        what = f"a running replica of app {app!r} with its own HTTP port (Serve's direct ingress)"
        return LiveReplicas(
            lambda: list_replica_endpoints(app), capacity, self._settings.refresh_interval_s, ranks, what
        )

    async def _follow_kv_events(self, subscriber: KVEventSubscriber) -> None:
        while True:
            await asyncio.sleep(self._settings.refresh_interval_s)
            try:
                await subscriber.sync(self._replicas.views())
            except Exception:
                logger.exception("following the replicas' KV events failed; trying again")

    async def __serve_build_asgi_app__(self) -> FastAPI:
        return self._app

    async def describe(self) -> dict[str, Any]:
        """The policy this router runs (`sluice status` reports it, not the spec file's), and for a policy fed by KV
        events where each replica's scores come from (`events`, `approximate`, `lost`) and its indexed blocks."""
        prefill = self._settings.prefill
        described: dict[str, Any] = {
            "policy": self._settings.policy,
            "policy_kwargs": self._settings.policy_kwargs,
            "prefill_policy": prefill.policy if prefill is not None else None,
        }
        if isinstance(self._policy, KVAware):
            described["kv_events"] = kv_index_report(self._policy)
        return described

    def __del__(self) -> None:
        listener = getattr(self, "_listener", None)
        if listener is not None:
            listener.close()


def router_application(
    settings: RouterSettings, num_replicas: int = 1, node_role: NodeRole | None = None
) -> Application:
    """The router app; deploy it with the route prefix of your choice (`serve.run(app, name=..., route_prefix=...)`).

    `num_cpus=0`: a router replica mostly waits on the network, and the control plane must never
    wait to be scheduled behind the replicas it routes to. No access log: every request makes a route call, so
    Serve would write a log line per request (CPU on the route call's path); `/metrics` counts the decisions."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    deployment = serve.deployment(RouterReplica).options(
        name=ROUTER_DEPLOYMENT_NAME,
        num_replicas=num_replicas,
        max_ongoing_requests=ROUTER_MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": 0, "resources": node_role_resources(node_role)},
        logging_config={"enable_access_log": False},
    )
    version = config_version([settings.model_dump(mode="json"), ROUTER_DEPLOYMENT_NAME, ROUTER_MAX_ONGOING_REQUESTS])
    return with_rollout_version(deployment, version).bind(settings.model_dump())


def build_router_application(args: dict[str, Any]) -> Application:
    """Serve's application builder (`import_path: services.router.service:build_router_application`)."""
    parsed = RouterAppArgs.model_validate(args)
    return router_application(parsed.settings, parsed.num_replicas, parsed.node_role)
