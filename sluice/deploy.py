"""`sluice deploy | status | down | render`: a team's stack on a running Ray cluster, from its spec file.

`deploy` applies the spec's plan (`builders.plan`) app by app, shows each app's state until the frontend has
every replica UP, prints the URL and returns: the stack (its frontend included) lives in the cluster, not in
this process. Ray's and Serve's own logs stay in the cluster's log folder.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import yaml

from base.contracts import NODE_BIND_ALL, SERVED_RANK_HEADER, WORKER_NODE_RESOURCE
from base.runtime import DEFAULT_SERVE_PROXY_PORT, apply_process_env
from builders.plan import PlannedModel, StackPlan, build_plan, model_path, serve_config
from infra.haproxy_canary import legacy_backend
from services.remote_prefill import PREFILL_REQUESTS_METRIC
from topologies.spec import TINY_MOE_SOURCE, TINY_SOURCE, load_spec

READY_TIMEOUT_S = 600.0
GCS_PROBE_TIMEOUT_S = 3.0
# A decode replica's count of the requests it served by prefill replica and outcome (services.remote_prefill).
_PREFILL_SAMPLE = re.compile(rf"^{PREFILL_REQUESTS_METRIC}_total\{{([^}}]*)\}} (\S+)$", re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def plan_of(path: str) -> tuple[Any, StackPlan]:
    spec = load_spec(path)
    return spec, build_plan(spec)


def render(path: str) -> str:
    _, plan = plan_of(path)
    header = f"# Rendered by `sluice render {path}`: deploy with `serve deploy`, or as KubeRay's serveConfigV2.\n"
    return header + yaml.safe_dump(serve_config(plan), sort_keys=False)


class NoClusterError(RuntimeError):
    pass


def connect(address: str) -> None:
    apply_process_env()
    import ray

    try:
        if address != "auto":
            host, _, port = address.removeprefix("ray://").rpartition(":")
            # Ray retries an unreachable GCS for a minute; one TCP connect says at once.
            socket.create_connection((host, int(port)), timeout=GCS_PROBE_TIMEOUT_S).close()
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    except (ConnectionError, OSError, ValueError) as error:
        raise NoClusterError(
            f"no Ray cluster at {address!r} ({error}): start one (`ray start --head --node-ip-address 127.0.0.1`) "
            "and give its address, or run the stack on a local Ray of its own with `sluice serve FILE`"
        ) from None


def _frontend_status(plan: StackPlan) -> dict[str, Any] | None:
    from ray import serve

    try:
        return serve.get_app_handle(plan.frontend_app).status.remote().result(timeout_s=10)
    except Exception:  # not deployed, or not running yet
        return None


def frontend_url(plan: StackPlan) -> str:
    """Where the deployed frontend listens, as it reports it: the head node's address on a stack across nodes."""
    status = _frontend_status(plan)
    return status["url"] if status and status.get("url") else plan.url


def ensure_models(spec: Any) -> None:
    """Build the tiny model if a model of the spec is `tiny` and it is not built yet."""
    from base.tiny_model import ensure_built

    sources = {model.source for model in spec.models}
    for source, moe in ((TINY_SOURCE, False), (TINY_MOE_SOURCE, True)):
        if source in sources:
            ensure_built(Path(model_path(source)), moe)


def apply_plan(spec: Any, plan: StackPlan) -> bool:
    """Deploy the plan's apps in order, showing each one's state, until the frontend has every replica UP."""
    from ray import serve

    started = time.monotonic()

    def say(line: str) -> None:
        print(f"[{time.monotonic() - started:5.1f} s] {line}", flush=True)

    for app in plan.apps:
        module, name = app.import_path.split(":")
        builder = getattr(importlib.import_module(module), name)
        say(f"{app.name}: deploying")
        serve.run(builder(app.args), name=app.name, route_prefix=app.route_prefix, blocking=False)
        say(f"{app.name}: {serve.status().applications[app.name].status.value}")
    wanted = [model.min_replicas for model in plan.models]
    while time.monotonic() - started < READY_TIMEOUT_S:
        status = _frontend_status(plan)
        if status and len(status["published"]) == len(wanted):
            if all(published >= n for published, n in zip(status["published"], wanted, strict=True)):
                for model in plan.models:
                    say(f"frontend: {model.name}: {model.min_replicas} replica(s) UP and published to its routers")
                settle_ingress(spec, plan, say)
                return True
        time.sleep(0.5)
    print(f"the frontend did not have every replica UP within {READY_TIMEOUT_S:.0f} s", file=sys.stderr)
    return False


def settle_ingress(spec: Any, plan: StackPlan, say: Any) -> None:
    """Wait for the declared ingress: the frontend reconfigured to its weight, a path that lost its traffic drained;
    then remove a legacy ingress the spec no longer retains."""
    from ray import serve

    frontend = serve.get_app_handle(plan.frontend_app)
    deadline = time.monotonic() + spec.ingress.drain_deadline_s + 30
    while True:
        ingress = frontend.ingress.remote().result(timeout_s=30)
        drain = ingress["drain"]
        drained = drain is None or drain["done"] or bool(drain["still_running"])
        if ingress["direct_weight"] == spec.ingress.direct_weight and drained or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    say(f"frontend: direct weight {ingress['direct_weight']}% (ingress mode {spec.ingress.mode})")
    if drain is not None:
        state = "drained" if drain["done"] else f"still streaming at the deadline: {drain['still_running']}"
        say(f"frontend: the {drain['path']} path {state}")
    for model in plan.models:
        if model.legacy_app and not model.legacy_deployed and model.legacy_app in serve.status().applications:
            serve.delete(model.legacy_app)
            say(f"{model.legacy_app}: deleted (the spec retains no legacy path)")


def serving_lines(spec: Any, plan: StackPlan) -> list[str]:
    lines = [f"\nsluice is serving at {plan.url}:"]
    for model, planned in zip(spec.models, plan.models, strict=True):
        what = " (the tiny model)" if model.source == TINY_SOURCE else ""
        lines.append(
            f"  {planned.name}{what}: HAProxy -> {planned.routers} router(s), policy {planned.policy} -> "
            f"{planned.min_replicas} vLLM replica(s)"
        )
    served = plan.models[0].name
    return [
        *lines,
        f"  curl -N {plan.url}/v1/chat/completions -H 'content-type: application/json' \\",
        f'    -d \'{{"model": "{served}", "messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 32, '
        '"stream": true}\'',
        f"  HAProxy metrics: http://{urlsplit(plan.url).hostname}:{spec.frontend.metrics_port}/metrics",
    ]


def delete_plan(plan: StackPlan) -> None:
    from ray import serve

    for app in reversed(plan.apps):  # the frontend first: nothing is routed to an app that is going away
        serve.delete(app.name)
        print(f"deleted {app.name}", flush=True)


def cluster_spans_nodes() -> bool:
    """Whether the connected cluster is made of sluice nodes with roles (`sluice node`, KubeRay): its worker nodes
    advertise WORKER_NODE_RESOURCE."""
    import ray

    return WORKER_NODE_RESOURCE in ray.cluster_resources()


def deploy(path: str, address: str) -> int:
    spec = load_spec(path)
    ensure_models(spec)
    connect(address)
    spans_nodes = cluster_spans_nodes()
    plan = build_plan(spec, spans_nodes=spans_nodes)
    if spans_nodes:
        from ray import serve

        # Serve's per-replica ports must be reachable from the head's HAProxy: each binds its node's interfaces.
        serve.start(http_options={"host": NODE_BIND_ALL, "port": DEFAULT_SERVE_PROXY_PORT})
        print("a cluster of sluice nodes: LLM replicas on the worker nodes, the frontend on the head", flush=True)
    if not apply_plan(spec, plan):
        return 1
    plan = plan.model_copy(update={"url": frontend_url(plan)})
    print("\n".join(serving_lines(spec, plan)))
    return 0


def degraded_reasons(spec: Any, plan: StackPlan, report: dict[str, Any]) -> list[str]:
    """Why a deployed stack is not ready (none: it is)."""
    reasons = []
    for app in plan.apps:
        state = report["apps"][app.name]["status"]
        if state != "RUNNING":
            reasons.append(f"app {app.name} is {state}")
    several = len(plan.models) > 1
    for model in plan.models:
        llm = report["apps"][model.llm_app]["replicas"]
        if len(llm) < model.min_replicas:
            what = "decode" if model.prefill_app else "LLM"
            reasons.append(f"{_of(model, several)}{len(llm)} of {model.min_replicas} {what} replicas running")
        if model.prefill_app is not None:
            prefill = report["apps"][model.prefill_app]["replicas"]
            if len(prefill) < model.prefill_replicas:
                reasons.append(
                    f"{_of(model, several)}{len(prefill)} of {model.prefill_replicas} prefill replicas running"
                )
    frontend = report.get("frontend") or {}
    if not frontend.get("running"):
        return [*reasons, "HAProxy is not running"]
    up: dict[str, int] = {}
    for server in frontend["servers"]:
        up[server["backend"]] = up.get(server["backend"], 0) + (server["status"] == "UP")
    for index, model in enumerate(plan.models):
        llm, routers = (len(report["apps"][app]["replicas"]) for app in (model.llm_app, model.router_app))
        if up.get(model.replica_backend, 0) < llm:
            reasons.append(
                f"{_of(model, several)}HAProxy has {up.get(model.replica_backend, 0)} of {llm} LLM replicas UP"
            )
        if up.get(model.router_backend, 0) < max(1, routers):
            reasons.append(
                f"{_of(model, several)}HAProxy has {up.get(model.router_backend, 0)} of {max(1, routers)} routers UP"
            )
        if model.legacy_deployed and model.legacy_app is not None:
            legacy = len(report["apps"][model.legacy_app]["replicas"])
            if up.get(legacy_backend(index), 0) < max(1, legacy):
                reasons.append(
                    f"{_of(model, several)}HAProxy has {up.get(legacy_backend(index), 0)} of {max(1, legacy)} "
                    "legacy ingress replicas UP"
                )
    return reasons


def _of(model: PlannedModel, several: bool) -> str:
    return f"{model.name}: " if several else ""


def app_roles(plan: StackPlan) -> dict[str, str]:
    """What each app of the plan is, for people reading `sluice status`."""
    roles = {plan.frontend_app: "HAProxy and its syncer"}
    for model in plan.models:
        roles[model.router_app] = f"routers of {model.name}"
        if model.legacy_deployed and model.legacy_app is not None:
            roles[model.legacy_app] = f"legacy ingress of {model.name} (the retained Python path)"
        if model.prefill_app is not None:
            roles[model.prefill_app] = f"prefill replicas of {model.name} (KV producers)"
            roles[model.llm_app] = f"decode replicas of {model.name} (KV consumers, pinned by HAProxy)"
        elif model.data_parallel == "in_engine":
            roles[model.llm_app] = f"replicas of {model.name}, {model.data_parallel_size} engine ranks each"
        elif model.data_parallel == "ranks":
            roles[model.llm_app] = f"rank replicas of {model.name}, gangs of {model.data_parallel_size}"
        else:
            roles[model.llm_app] = f"replicas of {model.name}"
    return roles


def model_line(model: PlannedModel) -> str:
    if model.prefill_app is not None:
        policy = f"decode policy {model.policy}, prefill policy {model.prefill_policy}"
    else:
        policy = f"policy {model.policy}"
    return f"  model {model.name}: {policy}, HAProxy backends {model.replica_backend} + {model.router_backend}"


def prefill_pairs(metrics_text: str) -> dict[tuple[str, str], float]:
    """(prefill replica, outcome) -> requests, from a decode replica's /metrics."""
    pairs: dict[tuple[str, str], float] = {}
    for labels, value in _PREFILL_SAMPLE.findall(metrics_text):
        named = dict(_LABEL.findall(labels))
        key = (named.get("prefill_replica", ""), named.get("outcome", ""))
        pairs[key] = pairs.get(key, 0.0) + float(value)
    return pairs


def _gang_rank(model: PlannedModel, endpoint: Any) -> str:
    """The DP rank a `ranks` replica answers as ("?" when it does not answer)."""
    try:
        response = httpx.get(f"{endpoint.url}/{model.llm_app}/v1/models", timeout=5)
    except httpx.HTTPError:
        return "?"
    return response.headers.get(SERVED_RANK_HEADER, "?")


def _pairs_report(model: PlannedModel, endpoints: list[Any]) -> list[dict[str, Any]]:
    """Which prefill replica served each decode replica's requests, and how (remote, local fallback, ...)."""
    served = []
    for endpoint in endpoints:
        try:
            text = httpx.get(f"{endpoint.url}/{model.llm_app}/metrics", timeout=5).text
        except httpx.HTTPError:
            continue
        for (prefill, outcome), count in sorted(prefill_pairs(text).items()):
            served.append({"decode": endpoint.replica_id, "prefill": prefill, "outcome": outcome, "requests": count})
    return served


def status(path: str, address: str, as_json: bool = False) -> int:
    spec, plan = plan_of(path)
    connect(address)
    from ray import serve

    from services.serve_internals import list_replica_endpoints

    applications = serve.status().applications
    report: dict[str, Any] = {"stack": f"{spec.team}/{spec.name}", "apps": {}, "pairs": {}}
    roles = app_roles(plan)
    endpoints_of = {}
    for app in plan.apps:
        state = applications.get(app.name)
        endpoints_of[app.name] = asyncio.run(list_replica_endpoints(app.name)) if state is not None else []
        report["apps"][app.name] = {
            "role": roles[app.name],
            "status": state.status.value if state is not None else "NOT_DEPLOYED",
            "replicas": [f"{e.replica_id} {e.host}:{e.port}" for e in endpoints_of[app.name]],
        }
    for model in plan.models:
        if model.prefill_app is not None:
            report["pairs"][model.name] = _pairs_report(model, endpoints_of[model.llm_app])
        if model.data_parallel == "ranks":
            report["apps"][model.llm_app]["replicas"] = [
                f"{e.replica_id} {e.host}:{e.port} rank {_gang_rank(model, e)}" for e in endpoints_of[model.llm_app]
            ]
    report["frontend"] = _frontend_status(plan)
    reasons = degraded_reasons(spec, plan, report)
    ready = not reasons
    report["state"] = "ready" if ready else "degraded: " + "; ".join(reasons)
    if as_json:
        print(json.dumps(report, indent=2))
        return 0 if ready else 1
    print(f"{report['stack']}: {report['state']}")
    for model in plan.models:
        print(model_line(model))
        for pair in report["pairs"].get(model.name, []):
            print(
                f"    pair decode {pair['decode']} <- prefill {pair['prefill'] or '-'}: "
                f"{pair['outcome']} {pair['requests']:.0f}"
            )
    for name, app_report in report["apps"].items():
        print(f"  app {name} ({app_report['role']}): {app_report['status']}")
        for replica in app_report["replicas"]:
            print(f"    replica {replica}")
    frontend = report["frontend"] or {}
    if frontend.get("running"):
        print(f"  ingress mode {spec.ingress.mode}: direct weight {frontend['direct_weight']}%")
        print(f"  HAProxy {frontend['url']} (master {frontend['master_pid']}, restarts {frontend['restarts']}):")
        for server in frontend["servers"]:
            print(f"    {server['backend']}/{server['server']} {server['addr']} {server['status']}")
    return 0 if ready else 1


def down(path: str, address: str) -> int:
    _, plan = plan_of(path)
    connect(address)
    delete_plan(plan)
    return 0
