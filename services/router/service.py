"""The router service: the control plane of the direct-streaming path (DESIGN.md §1, §3).

HAProxy's Lua action asks `POST /internal/route` which replica of the target app should serve a
request; the router answers a `RouteReply` (primary replica id, fallback ids, capacity token) or a
503 `RouteRefusal` with a reason. It decides only: the request and its token stream go from HAProxy
straight to the chosen replica's own port, never through the router.

Serving. `RouterReplica` is a Ray Serve deployment whose FastAPI app is served on each router
replica's own direct-ingress port (like the LLM replica), so every router replica is discoverable
with `list_replica_endpoints(<router app>)`. The route path on that port is the app's
`route_prefix` + `ROUTE_PATH` (Serve only serves paths under the prefix); the frontend's syncer
publishes its membership at `route_prefix` + `MEMBERSHIP_PATH`. `GET /metrics` on the same app exports
the router's counters together with the policies' decision counters. HAProxy's route calls themselves go to the
replica's route listener (services.router.route_listener: the same answer without Serve's per-request cost), whose port
the app tells at `route_prefix` + `ROUTE_LISTENER_PATH`. A capacity_queue router's `/metrics` also exports its ledger's
tokens, read from the ledger actor at each scrape (`routers.metrics.LEDGER_METRICS`).

Replica set. Each router replica polls `list_replica_endpoints(target_app)` every
`refresh_interval_s` (0.25 s: a replaced replica is routable within a quarter second, for one
controller call per router replica per interval) and keeps the last known set when a poll fails.
The ids are Serve's replica unique ids, the very ids the LLM replicas stamp as `x-serve-replica`,
and the views depend only on the set, so consistent hash gives the same answer on every router
replica without any coordination. The constructor returns only once it knows a non-empty set, so
Serve opens the router's port (and `/-/healthz` on it) only then. Serve's list is the candidate set;
the set a frontend publishes (`Membership`, the replicas it has UP and not leaving) narrows it for that
frontend's route calls (`x-sluice-frontend`), so the router never ranks a replica the asking frontend
cannot reach and the primary it names is one the frontend can actually use. The rule is in
`services.router.membership`; an empty result is a 503 `no_replica` (fail closed).

In-flight counts. A policy's tracker counts a request on its primary at decision time and forgets
it when told the request completed; on the direct path the router is never told (the stream runs
HAProxy -> replica). So the tracker forgets each decision after `forget_after_s` (2 s; pruning runs
at most once a second, so 2-3 s): its count per replica is the requests placed there in the last
few seconds, a recent-load estimate that still spreads a burst (each decision sees the earlier ones
at once) and does not grow with uptime as the core's default 900 s (a quarter hour of traffic) would.
Each router replica counts only its own decisions. capacity_queue does not depend on it: its ledger
counts exact in-flight tokens.

Capacity tokens (capacity_queue). The policy takes a token from the deployment's central ledger
actor (`ledger_actor_name(target_app, target_deployment)`), the reply carries its id, HAProxy passes
it to the replica in `x-sluice-capacity-token`, and the replica releases it when the request ends
(`services.replica.middleware.capacity_release`). A token whose reply or request is lost on the way is taken back by
the ledger's TTL reaper.

Request body. Empty unless body forwarding is on for the app; then it is the client body up to the
buffer limit, and `x-body-truncated: have/total` says it was cut. The `"model"` and `"user"` fields
are read with json when the body parses, else with a regex on the prefix, else they are None: a
truncated or invalid body never fails the route call. consistent_hash with `user_affinity` keys on
`user` when a request has no session header. `x-sluice-app` is accepted and not needed: each router serves one
target app, and HAProxy sends each app's route calls to that app's router.

Prefill/decode. The target app is the decode app (the replicas HAProxy pins to); `prefill` names the prefill app,
whose replicas the router polls the same way. Each route call picks the prefill replica first, with the prefill
side's own stateless policy over Serve's list of prefill replicas (no frontend routes to them: the decode replica
calls the one chosen), then the decode side as above; the reply names both. Prefill first, so a refusal there
never strands a decode-side capacity token. No prefill replica is a 503 `no_prefill_replica`, unless the decode
replicas may prefill locally (`PrefillTarget.required` false): then the reply names none and the decode replica
prefills the request itself, saying so in its response.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray
from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from ray import serve
from ray.serve.deployment import Application

from base.contracts import (
    DEFAULT_MAX_ONGOING_REQUESTS,
    FAULT_PATH,
    FRONTEND_HEADER,
    MEMBERSHIP_PATH,
    REASON_INJECTED_FAULT,
    REASON_NO_PREFILL_REPLICA,
    ROUTE_PATH,
    SESSION_HEADER_DEFAULT,
    NodeRole,
    node_role_resources,
)
from base.rollout import config_version
from base.route_wire import Membership, RouteRefusal, RouteReply
from infra.observability.targets import METRICS_PATH
from routers.capacity_queue import CapacityQueue, LedgerClient
from routers.config import CapacityQueueSettings, build_stateless_policy, validate_settings
from routers.core import Decision, InFlightTracker, NoReplicaAvailable, ReplicaView, RouteRequest, RoutingPolicy
from routers.ledger_actor import capacity_queue_policy
from routers.metrics import LEDGER_METRICS
from services.replica.llm_config import LLM_DEPLOYMENT_NAME
from services.router.live_replicas import LiveReplicas
from services.router.membership import FrontendMembership
from services.router.route_listener import ROUTE_LISTENER_PATH, RouteListener
from services.router.route_request import route_request_from
from services.serve_internals import list_replica_endpoints, with_rollout_version

ROUTER_DEPLOYMENT_NAME = "Router"
# Serve counts route calls against this. A decision takes about a millisecond, but a capacity_queue
# call may wait up to its `max_wait_s`; Serve's default of 5 would queue every call behind 5 waiters.
ROUTER_MAX_ONGOING_REQUESTS = 1024
_JSON = "application/json"


ROUTED_TOTAL = Counter("sluice_router_routed", "Route calls answered with a replica.", ["app", "policy"])
REFUSED_TOTAL = Counter("sluice_router_refused", "Route calls refused (503) by reason.", ["app", "policy", "reason"])
TRUNCATED_TOTAL = Counter(
    "sluice_router_truncated_bodies", "Route calls whose forwarded body was cut at the buffer limit.", ["app"]
)
MEMBERSHIP_UPDATES_TOTAL = Counter(
    "sluice_router_membership_updates", "Frontend membership publications accepted (heartbeats included).", ["app"]
)


class PolicyChoice(BaseModel):
    """A routing policy and its kwargs, checked against the policy's own settings."""

    model_config = ConfigDict(extra="forbid")

    policy: str = "round_robin"
    policy_kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _policy_kwargs(self) -> PolicyChoice:
        # PolicyConfigError is a ValueError: pydantic reports its message as the validation error.
        validate_settings(self.policy, self.policy_kwargs)
        return self


class PrefillTarget(PolicyChoice):
    """Prefill/decode: the prefill app a router also chooses from for every request, with its own policy."""

    app: str = Field(min_length=1)
    # The prefill app's route prefix: its replicas serve vLLM's paths under it.
    route_prefix: str = ""
    deployment: str = LLM_DEPLOYMENT_NAME
    capacity: int = Field(DEFAULT_MAX_ONGOING_REQUESTS, ge=1)
    policy: str = "power_of_two"
    # False when the decode replicas prefill locally if need be: with no prefill replica the decode side is
    # routed anyway (and the decode replica says it prefilled locally) instead of a 503 `no_prefill_replica`.
    required: bool = True

    @field_validator("policy")
    @classmethod
    def _stateless(cls, value: str) -> str:
        # A capacity token is released by the replica it was taken for; the decode replica's prefill call carries none.
        if value == "capacity_queue":
            raise ValueError(
                "the prefill side takes no capacity tokens: choose power_of_two, round_robin or consistent_hash"
            )
        return value


class RouterSettings(PolicyChoice):
    """What one router app routes to and how."""

    target_app: str = Field(min_length=1)
    target_deployment: str = LLM_DEPLOYMENT_NAME
    # The target deployment's `max_ongoing_requests`: each replica's capacity in the views.
    target_capacity: int = Field(DEFAULT_MAX_ONGOING_REQUESTS, ge=1)
    session_header: str = SESSION_HEADER_DEFAULT
    refresh_interval_s: float = Field(0.25, gt=0)
    # How long the tracker counts a decision as in flight (the router never sees completions).
    forget_after_s: float = Field(2.0, gt=0)
    # Prefill/decode: the prefill side, chosen with the decode replica.
    prefill: PrefillTarget | None = None
    # In-engine data parallelism: each target replica runs this many engine ranks, ranked as `<replica>:<rank>`.
    data_parallel_size: int = Field(1, ge=1)
    # Staging stacks only: `POST <prefix>/internal/fault {"seconds": s}` makes every route call fail for s seconds.
    fault_injection: bool = False

    @field_validator("session_header")
    @classmethod
    def _header_name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9-]+", value):
            raise ValueError(f"invalid header name {value!r}")
        return value.lower()


def build_policy(settings: RouterSettings, ledger: LedgerClient | None = None) -> RoutingPolicy:
    """The policy the settings name. capacity_queue uses `ledger`, else the deployment's ledger actor."""
    if settings.policy == "capacity_queue":
        queue_settings = validate_settings(settings.policy, settings.policy_kwargs)
        assert isinstance(queue_settings, CapacityQueueSettings)
        policy: RoutingPolicy = capacity_queue_policy(
            settings.target_app, settings.target_deployment, queue_settings, ledger
        )
    else:
        policy = build_stateless_policy(settings.policy, settings.policy_kwargs)
    policy.tracker = InFlightTracker(forget_after_s=settings.forget_after_s)
    return policy


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

    async def answer(headers: Mapping[str, str], body: bytes) -> tuple[int, str]:
        """A route call's status and JSON reply (the route endpoint's and the route listener's)."""
        if fault.active():
            return 500, RouteRefusal(reason=REASON_INJECTED_FAULT).model_dump_json()
        route_request = route_request_from(headers, body, settings.session_header)
        if route_request.body_truncated:
            truncated_bodies.inc()
        frontend = headers.get(FRONTEND_HEADER) or None
        try:
            prefill_replica = prefill.choose(route_request) if prefill is not None else None
            decision = await policy.decide(membership.routable(replicas(), frontend), route_request)
        except NoReplicaAvailable as refusal:
            REFUSED_TOTAL.labels(settings.target_app, policy.name, refusal.reason).inc()
            return 503, RouteRefusal(reason=refusal.reason).model_dump_json()
        routed.inc()
        return 200, route_reply(decision, prefill_replica).wire_json()

    app.state.answer_route = answer
    app.state.route_listener_port = None

    @app.post(ROUTE_PATH)
    async def route(request: Request) -> Response:
        status, reply = await answer(request.headers, await request.body())
        return Response(reply, status_code=status, media_type=_JSON)

    @app.get(ROUTE_LISTENER_PATH)
    async def route_listener() -> Response:
        port = app.state.route_listener_port
        if port is None:
            return Response('{"detail": "no route listener"}', status_code=404, media_type=_JSON)
        return Response(json.dumps({"port": port}), media_type=_JSON)

    @app.post(MEMBERSHIP_PATH)
    async def publish_membership(request: Request) -> Response:
        try:
            published = Membership.model_validate_json(await request.body())
        except ValidationError as error:
            # Invalid JSON is a ValidationError too; the context may hold exceptions, which json cannot dump.
            detail = error.errors(include_url=False, include_input=False, include_context=False)
            return Response(json.dumps({"detail": detail}), status_code=422, media_type=_JSON)
        membership.publish(published)
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
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


@serve.ingress()
class RouterReplica:
    async def __init__(self, settings: dict[str, Any]) -> None:
        self._settings = RouterSettings.model_validate(settings)
        policy = build_policy(self._settings)
        self._replicas = self._live_replicas(
            self._settings.target_app, self._settings.target_capacity, self._settings.data_parallel_size
        )
        await self._replicas.start()
        prefill = None
        if self._settings.prefill is not None:
            side = self._settings.prefill
            prefill_policy = build_stateless_policy(side.policy, side.policy_kwargs)
            prefill_policy.tracker = InFlightTracker(forget_after_s=self._settings.forget_after_s)
            self._prefill_replicas = self._live_replicas(side.app, side.capacity)
            await self._prefill_replicas.start()
            prefill = PrefillChooser(prefill_policy, self._prefill_replicas.views, side.route_prefix, side.required)
        self._app = build_router_app(self._settings, policy, self._replicas.views, prefill)
        self._listener = RouteListener(self._app.state.answer_route)
        self._app.state.route_listener_port = await self._listener.start(ray.util.get_node_ip_address())

    def _live_replicas(self, app: str, capacity: int, ranks: int = 1) -> LiveReplicas:
        # An app whose replicas run but list no endpoint was started by a Serve without direct ingress.
        what = f"a running replica of app {app!r} with its own HTTP port (Serve's direct ingress)"
        return LiveReplicas(
            lambda: list_replica_endpoints(app), capacity, self._settings.refresh_interval_s, ranks, what
        )

    async def __serve_build_asgi_app__(self) -> FastAPI:
        return self._app

    async def describe(self) -> dict[str, Any]:
        """The policy this router runs (`sluice status` reports it, not the spec file's)."""
        prefill = self._settings.prefill
        return {
            "policy": self._settings.policy,
            "policy_kwargs": self._settings.policy_kwargs,
            "prefill_policy": prefill.policy if prefill is not None else None,
        }

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


class RouterAppArgs(BaseModel):
    """What `build_router_app` takes from a Serve config's `args`."""

    model_config = ConfigDict(extra="forbid")

    settings: RouterSettings
    num_replicas: int = Field(1, ge=1)
    # A stack across nodes runs its routers on the head node; None: one machine.
    node_role: NodeRole | None = None


def build_router_application(args: dict[str, Any]) -> Application:
    """Serve's application builder (`import_path: services.router.service:build_router_application`)."""
    parsed = RouterAppArgs.model_validate(args)
    return router_application(parsed.settings, parsed.num_replicas, parsed.node_role)
