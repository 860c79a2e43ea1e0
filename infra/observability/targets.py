"""Where Prometheus finds a stack's routers and LLM replicas, whose Serve ports change when a replica is replaced.

The frontend answers Prometheus's HTTP service discovery itself (`GET TARGETS_PATH` on its metrics port, the Lua
service in `frontend_metrics.lua.tmpl` beside this module) from HAProxy's live servers; a router's Serve address is
kept in `router_targets_backend(i)` for it. Details: infra/README.md (observability).
"""

from __future__ import annotations

# GET on the frontend's metrics port: Prometheus HTTP service discovery (JSON list of target groups).
TARGETS_PATH = "/sluice/targets"
TARGETS_ROLE_PARAM = "role"
LUA_TARGETS_SERVICE = "sluice_targets"
# Where routers (`services.router.http_app`) and vLLM replicas serve Prometheus text, under their app's route prefix.
METRICS_PATH = "/metrics"
ROLE_ROUTER = "router"
ROLE_REPLICA = "replica"
# Labels of every discovered target. `sluice_` prefixed: a router's own metrics already carry `app`.
METRICS_PATH_LABEL = "__metrics_path__"
ROLE_LABEL = "sluice_role"
APP_LABEL = "sluice_app"
REPLICA_LABEL = "sluice_replica"
# Per app, the routers' Serve addresses (discovery only; the first app's keeps the plain name).
ROUTER_TARGETS_BACKEND = "sluice_router_targets"


def router_targets_backend(index: int) -> str:
    return ROUTER_TARGETS_BACKEND if index == 0 else f"{ROUTER_TARGETS_BACKEND}_{index}"


def metrics_path(route_prefix: str) -> str:
    """Where a router or LLM replica served under `route_prefix` answers Prometheus."""
    return route_prefix + METRICS_PATH
