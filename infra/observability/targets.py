"""Where Prometheus finds a stack's routers and LLM replicas, whose Serve ports change when a replica is replaced.

The frontend's HAProxy already holds every live replica and router as a server of its backends (the syncer keeps
them current through the runtime API), so the frontend answers Prometheus's HTTP service discovery
(`http_sd_configs`) itself: `GET TARGETS_PATH` on its metrics port lists one target group per replica and router
server, each with the path its metrics are served at (`__metrics_path__`: the app's route prefix + `METRICS_PATH`)
and labels naming its role, app and replica id; `?role=router` or `?role=replica` keeps one role. The Lua service
(`frontend_metrics.lua.tmpl` beside this module) builds the list from HAProxy's servers at each request, so a
replaced replica is listed at its new port from the syncer's next pass (a quarter second) on, and a server in
maintenance (leaving) is no longer listed.

A router's HAProxy server points at its route listener, whose port serves no metrics, so the syncer keeps each
router's Serve address in a backend of its own, `router_targets_backend(i)`: servers without health checks that no
traffic ever reaches, read only by the discovery.
"""

from __future__ import annotations

from infra.haproxy.apps import AppRoute

# GET on the frontend's metrics port: Prometheus HTTP service discovery (JSON list of target groups).
TARGETS_PATH = "/sluice/targets"
TARGETS_ROLE_PARAM = "role"
LUA_TARGETS_SERVICE = "sluice_targets"
# Where routers (`services.router.service`) and vLLM replicas serve Prometheus text, under their app's route prefix.
METRICS_PATH = "/metrics"
ROLE_ROUTER = "router"
ROLE_REPLICA = "replica"
ROLES = (ROLE_ROUTER, ROLE_REPLICA)
# Labels of every discovered target. `sluice_` prefixed: a router's own metrics already carry `app`.
METRICS_PATH_LABEL = "__metrics_path__"
ROLE_LABEL = "sluice_role"
APP_LABEL = "sluice_app"
REPLICA_LABEL = "sluice_replica"
# Per app, the routers' Serve addresses (discovery only; the first app's keeps the plain name).
ROUTER_TARGETS_BACKEND = "sluice_router_targets"


def router_targets_backend(index: int) -> str:
    return ROUTER_TARGETS_BACKEND if index == 0 else f"{ROUTER_TARGETS_BACKEND}_{index}"


def router_metrics_path(app: AppRoute) -> str:
    return app.router_route_prefix + METRICS_PATH


def replica_metrics_path(app: AppRoute) -> str:
    return app.replica_route_prefix + METRICS_PATH
