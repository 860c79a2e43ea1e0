"""The router service: the control plane of the direct-streaming path (docs/design.md §1, §3).

HAProxy asks which replica of the target app should serve a request (an SPOE message to the replica's route agent,
or `POST /internal/route` on this app); the router answers a `RouteReply` (primary, fallbacks, capacity token, and for
prefill/decode the prefill replica) or a 503 `RouteRefusal` with a reason. It decides only: the request and its
tokens go from HAProxy straight to the chosen replica. `RouterReplica` is the Serve deployment; its candidates are
Serve's endpoint list, narrowed per frontend. Its HTTP app is `http_app.py`, the prefill side of a prefill/decode
router `prefill_side.py`; what it does for a particular policy (KV event following, its report) it asks the policy's
registry entry. What it talks to, and why each interval: services/router/README.md.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from fastapi import FastAPI
from ray import serve
from ray.serve.deployment import Application

from base.contracts import NodeRole, node_role_resources
from base.rollout import config_version
from routers.registry import policy_entry
from services.internal_credential import InternalCredentialMiddleware, internal_credential, internal_headers
from services.router.http_app import build_router_app
from services.router.kv_subscriber import KVEventSubscriber
from services.router.live_replicas import LiveReplicas
from services.router.prefill_side import PrefillChooser
from services.router.route_listener import RouteListener
from services.router.settings import RouterAppArgs, RouterSettings, build_policy, build_prefill_policy
from services.serve_internals import REPLICA_LOGGER, list_replica_endpoints, with_rollout_version

logger = logging.getLogger(REPLICA_LOGGER)

ROUTER_DEPLOYMENT_NAME = "Router"
# Serve counts route calls against this. A decision takes about a millisecond, but a call of a capacity-metered
# policy may wait up to its `max_wait_s`; Serve's default of 5 would queue every call behind 5 waiters.
ROUTER_MAX_ONGOING_REQUESTS = 1024


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
        event_target = policy_entry(self._settings.policy).kv_event_target
        if event_target is not None:
            self._kv_events = KVEventSubscriber(
                event_target(policy),
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
        """The policy this router runs (`sluice status` reports it, not the spec file's), and the policy's own report
        under its key when its registry entry has one (kv_aware: where each replica's scores come from)."""
        prefill = self._settings.prefill
        described: dict[str, Any] = {
            "policy": self._settings.policy,
            "policy_kwargs": self._settings.policy_kwargs,
            "prefill_policy": prefill.policy if prefill is not None else None,
        }
        report = policy_entry(self._settings.policy).report
        if report is not None:
            described[report.key] = report.build(self._policy)
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
