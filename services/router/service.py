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

import functools
from typing import Any

import ray
from fastapi import FastAPI
from ray import serve
from ray.serve.deployment import Application

from base.contracts import NodeRole, node_role_resources
from base.rollout import config_version
from routers.metrics import DECISION_SECONDS
from services.internal_credential import internal_credential
from services.router.runtime import EndpointSource, RouterRuntime
from services.router.settings import RouterAppArgs, RouterSettings
from services.serve_internals import list_replica_endpoints, with_rollout_version

ROUTER_DEPLOYMENT_NAME = "Router"
# Serve counts route calls against this. A decision takes about a millisecond, but a call of a capacity-metered
# policy may wait up to its `max_wait_s`; Serve's default of 5 would queue every call behind 5 waiters.
ROUTER_MAX_ONGOING_REQUESTS = 1024


@serve.ingress()
class RouterReplica:
    async def __init__(self, settings: dict[str, Any]) -> None:
        parsed = RouterSettings.model_validate(settings)
        side = parsed.prefill
        decisions = DECISION_SECONDS.labels(parsed.target_app, parsed.policy)
        self._runtime = RouterRuntime(
            parsed,
            self._endpoints(parsed.target_app),
            internal_credential(),
            self._endpoints(side.app) if side is not None else None,
            # An app whose replicas run but list no endpoint was started by a Serve without direct ingress.
            what=f"a running replica of app {parsed.target_app!r} with its own HTTP port (Serve's direct ingress)",
            observe_decision=decisions.observe,
        )
        await self._runtime.start(ray.util.get_node_ip_address())

    @staticmethod
    def _endpoints(app: str) -> EndpointSource:
        return functools.partial(list_replica_endpoints, app)

    async def __serve_build_asgi_app__(self) -> FastAPI:
        assert self._runtime.app is not None
        return self._runtime.app

    async def describe(self) -> dict[str, Any]:
        """The policy this router runs (`sluice status` reports it, not the spec file's), and the policy's own report
        under its key when its registry entry has one (kv_aware: where each replica's scores come from)."""
        return self._runtime.describe()

    def __del__(self) -> None:
        runtime = getattr(self, "_runtime", None)
        if runtime is not None and runtime.listener is not None:
            runtime.listener.close()
        if runtime is not None:
            runtime.stop_tracing()


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
