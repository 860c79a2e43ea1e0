"""Preflight: whether the Ray cluster at hand can run a sluice stack, answered in seconds, before anything is deployed.

`connect` (every cluster command), `connect_to_serve` (also Serve's controller), `preflight` (`deploy`: reachable,
Serve's controller settings, no other running stack's frontend on the stack's ports, resources, sluice importable on
the workers; a cluster beyond loopback without Ray's token authentication warned about). Each problem is a
`PreflightError` naming the exact fix; the CLI exits with `PREFLIGHT_EXIT_CODE`. The checks one by one:
`sluice/deploy/README.md`.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from base.contracts import NODE_BIND_ALL, WORKER_NODE_RESOURCE
from base.runtime import (
    COMPATIBLE_RAY_START,
    DEFAULT_SERVE_PROXY_PORT,
    LOOPBACK,
    SERVE_CONTROLLER_ENV_KEYS,
    apply_process_env,
    carried_env,
    process_env,
    serve_controller_env,
)
from builders.plan import StackPlan, frontend_app_name
from sluice.deploy import registry
from sluice.deploy.exit_codes import EXIT_UNREACHABLE
from topologies.sections import listening_ports

PREFLIGHT_EXIT_CODE = EXIT_UNREACHABLE
if TYPE_CHECKING:
    from services.serve_internals import ControllerSettings

# The whole preflight answers within 10 s: each probe gets a share of it.
GCS_PROBE_TIMEOUT_S = 3.0
CONTROLLER_PROBE_TIMEOUT_S = 3.0
WORKER_PROBE_TIMEOUT_S = 3.0
# Ray Serve binds each replica's inter-deployment gRPC server on every interface (Ray 2.60: `[::]:0`), outside
# sluice's bind settings; only Ray's token authentication stands between it and the network.
UNGUARDED_CLUSTER = (
    "warning: this cluster runs without Ray's token authentication (RAY_AUTH_MODE=disabled) on an address beyond "
    "loopback: Ray Serve's own gRPC port on each replica listens on every interface and takes calls there past the "
    "frontend's keys, limits and internal credential, from anyone who reaches the node (as Ray's own ports do).\n"
    "  fix: restart Ray with token authentication (`ray stop`, then `ray start` without RAY_AUTH_MODE=disabled; "
    "`ray get-auth-token --generate` makes a token), or keep the nodes behind a firewall (docs/deploy.md)"
)
# Replica fits are compared with this much slack (Ray's fractional resources are fixed-point).
_RESOURCE_SLACK = 1e-4


class PreflightError(RuntimeError):
    """The cluster cannot run a sluice stack: what is wrong and the exact fix."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"preflight: {problem}\n  fix: {fix}")
        self.problem = problem
        self.fix = fix


def ray_start_line() -> str:
    """The `ray start` line of a cluster whose own environment has every setting Serve's controller needs."""
    env = process_env()
    return " ".join(f"{key}={env[key]}" for key in SERVE_CONTROLLER_ENV_KEYS) + " " + COMPATIBLE_RAY_START


def _gcs_address(address: str) -> str | None:
    """The GCS address `address` names (`auto`: RAY_ADDRESS, else Ray's own lookup of the local cluster)."""
    if address == "auto":
        return os.environ.get("RAY_ADDRESS") or None
    return address.removeprefix("ray://")


def connect(address: str) -> None:
    """Connect this process to the cluster as a driver whose apps carry sluice's environment (`carried_env`)."""
    apply_process_env()
    import ray

    from services.serve_internals import send_ray_token_if_present

    if ray.is_initialized():
        return
    send_ray_token_if_present()
    fix = f"start one: `{COMPATIBLE_RAY_START}` (or `sluice node head`), then give its address with --address"
    gcs = _gcs_address(address)
    if gcs is not None:
        host, _, port = gcs.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=GCS_PROBE_TIMEOUT_S).close()
        except (OSError, ValueError) as error:
            raise PreflightError(f"no Ray cluster at {gcs!r} ({error})", fix) from None
    try:
        ray.init(
            address=address,
            runtime_env={"env_vars": carried_env()},
            log_to_driver=False,
            logging_level=logging.getLogger("ray").getEffectiveLevel(),
        )
    except (ConnectionError, OSError, ValueError, RuntimeError) as error:
        raise PreflightError(f"no Ray cluster at {address!r} ({error})", fix) from None


def _alive_nodes() -> list[dict[str, Any]]:
    import ray

    return [node for node in ray.nodes() if node.get("Alive")]


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def nodes_on_loopback() -> bool:
    return all(_is_loopback(node["NodeManagerAddress"]) for node in _alive_nodes())


def cluster_spans_nodes() -> bool:
    """Whether the cluster is made of sluice nodes with roles (`sluice node`, KubeRay): its worker nodes advertise
    WORKER_NODE_RESOURCE."""
    import ray

    return WORKER_NODE_RESOURCE in ray.cluster_resources()


def _worker_facts() -> tuple[str, bool]:
    """On a worker: where sluice's replica module is imported from, and whether the cluster authenticates with Ray's
    token (a worker has the cluster's mode; a driver only its own)."""
    import services.replica.llm_replica
    from services.serve_internals import token_auth_enabled

    return str(services.replica.llm_replica.__file__), token_auth_enabled()


def check_workers(on_loopback: bool) -> None:
    """A worker of the cluster imports sluice's replica module; a cluster too busy to start a worker within the
    probe's time is let through (its replicas would say the same, later), unasked about its authentication. A
    cluster beyond loopback without Ray's token authentication is warned about (`UNGUARDED_CLUSTER`), not refused:
    the exposure is Ray's own."""
    import ray

    probe = ray.remote(num_cpus=0)(_worker_facts)
    try:
        _, token_auth = ray.get(probe.remote(), timeout=WORKER_PROBE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        return
    except (ray.exceptions.RayTaskError, ray.exceptions.RaySystemError, ModuleNotFoundError) as error:
        raise PreflightError(
            f"the cluster's workers cannot import sluice ({type(error).__name__})",
            f"start Ray from sluice's environment (`.venv/bin/ray`, after `make venv`): `{COMPATIBLE_RAY_START}`",
        ) from None
    if not token_auth and not on_loopback:
        print(UNGUARDED_CLUSTER, file=sys.stderr, flush=True)


def check_serve_controller(must_reach_nodes: bool) -> ControllerSettings | None:
    """The running Serve controller's settings (None: none runs); PreflightError when it runs without what sluice
    needs."""
    from services.serve_internals import serve_controller_settings

    settings = serve_controller_settings(list(SERVE_CONTROLLER_ENV_KEYS), CONTROLLER_PROBE_TIMEOUT_S)
    if settings is None:
        return None
    others = ", ".join(settings.applications) or "none"
    restart = (
        f"`serve shutdown -y` (deletes every Serve app of the cluster; running now: {others}) and deploy again: "
        f"sluice starts Serve with its settings; or restart Ray with them: `ray stop`, then `{ray_start_line()}`"
    )
    if not settings.direct_ingress:
        raise PreflightError(
            "Serve's controller runs without direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS=1): no replica "
            "would get its own HTTP port, and the routers would wait for endpoints forever",
            restart,
        )
    if settings.env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        raise PreflightError("Serve's controller runs Ray's own HAProxy (RAY_SERVE_ENABLE_HA_PROXY=1)", restart)
    if must_reach_nodes and _is_loopback(settings.http_host):
        raise PreflightError(
            f"Serve's HTTP binds {settings.http_host}, but the cluster's nodes are not on loopback: HAProxy could "
            "not reach the replicas' own ports",
            f"`serve shutdown -y` (running now: {others}) and deploy again: sluice starts Serve on the node's address",
        )
    return settings


def check_frontend_ports(stack: str, ports: dict[int, str], running_apps: Iterable[str]) -> None:
    """No other stack whose frontend still runs listens on one of `ports` (port -> the field asking for it): two
    HAProxies on one port would split its connections between two stacks without a word. A stack's record outlives
    a frontend deleted without `sluice down`, so only frontends Serve runs count."""
    running = set(running_apps)
    for other in registry.deployed_stacks():
        if other.stack == stack or frontend_app_name(other.stack) not in running:
            continue
        held = listening_ports(other.spec.get("frontend", {}))
        for port, field in sorted(ports.items()):
            if port in held:
                raise PreflightError(
                    f"port {port} ({field}) is held by stack {other.stack!r}, whose frontend listens there "
                    f"({held[port]})",
                    f"give this stack's {field} another port, or take {other.stack!r} down first "
                    f"(`sluice down {other.stack}`)",
                )


def connect_to_serve(address: str) -> None:
    """`connect`, then the Serve controller's check: what `status`, `check`, `canary` and `rollback` need."""
    connect(address)
    check_serve_controller(must_reach_nodes=False)


def replica_demands(plan: StackPlan) -> Iterable[tuple[str, dict[str, float], int]]:
    """(deployment, resources of one replica, replicas) of each planned deployment that asks for resources."""
    for app in plan.apps:
        deployment = app.args.get("deployment")
        if not isinstance(deployment, dict):
            continue
        one: dict[str, float] = {"CPU": float(deployment.get("num_cpus", 0.0))}
        if deployment.get("num_gpus"):
            one["GPU"] = float(deployment["num_gpus"])
        if deployment.get("accelerator_type"):
            one[f"accelerator_type:{deployment['accelerator_type']}"] = 0.001
        autoscaling = deployment.get("autoscaling") or {}
        replicas = int(autoscaling.get("min_replicas", deployment.get("num_replicas", 1)))
        replicas *= int(deployment.get("gang_size") or 1)
        yield app.name, one, replicas


def check_resources(plan: StackPlan) -> None:
    import ray

    nodes = [node["Resources"] for node in _alive_nodes()]
    total = ray.cluster_resources()
    wanted: dict[str, float] = {}
    for app, one, replicas in replica_demands(plan):
        if not any(all(node.get(k, 0.0) + _RESOURCE_SLACK >= v for k, v in one.items()) for node in nodes):
            raise PreflightError(
                f"no node of the cluster can hold one replica of {app} ({one})",
                "add a node with these resources (`ray start --address ... --num-cpus/--num-gpus`), or lower the "
                "model's `resources` in the spec",
            )
        for key, value in one.items():
            wanted[key] = wanted.get(key, 0.0) + value * replicas
    short = {k: (v, total.get(k, 0.0)) for k, v in wanted.items() if total.get(k, 0.0) + _RESOURCE_SLACK < v}
    if short:
        said = ", ".join(f"{k}: the plan asks for {v:g}, the cluster has {have:g}" for k, (v, have) in short.items())
        raise PreflightError(
            f"the cluster cannot hold every replica the spec asks for ({said})",
            "add nodes, or lower the models' replicas or resources in the spec",
        )


def serve_http_host(spans_nodes: bool) -> str:
    """Where Serve's HTTP binds (its proxy and every replica's own port): loopback on a loopback cluster; on one node
    elsewhere, that node's own address, never a wildcard (past the frontend nothing checks keys or limits); only a
    cluster of several nodes binds every interface, since Serve takes one host for all nodes (a private network
    there: docs/deploy.md)."""
    nodes = _alive_nodes()
    if not spans_nodes and all(_is_loopback(node["NodeManagerAddress"]) for node in nodes):
        return LOOPBACK
    if not spans_nodes and len(nodes) == 1:
        return str(nodes[0]["NodeManagerAddress"])
    return NODE_BIND_ALL


def serve_start_options(spans_nodes: bool) -> dict[str, Any]:
    """What `deploy` starts Serve with when no controller runs: its HTTP where HAProxy reaches the replicas
    (`serve_http_host`), the controller's environment through `controller_options`."""
    host = serve_http_host(spans_nodes)
    return {
        "http_options": {"host": host, "port": DEFAULT_SERVE_PROXY_PORT},
        "controller_options": {"runtime_env": {"env_vars": serve_controller_env()}},
    }


def preflight(plan: StackPlan, spans_nodes: bool, frontend_ports: dict[int, str]) -> dict[str, Any] | None:
    """The full check before a deploy: None when Serve runs already (compatible), else how to start it."""
    on_loopback = nodes_on_loopback()
    running = check_serve_controller(must_reach_nodes=spans_nodes or not on_loopback)
    if running is not None:
        check_frontend_ports(plan.stack, frontend_ports, running.applications)
    check_resources(plan)
    check_workers(on_loopback)
    return None if running is not None else serve_start_options(spans_nodes)
