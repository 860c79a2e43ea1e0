"""`sluice status [FILE | STACK]`: what runs on the cluster, not what a file says.

No argument: every sluice stack (`sluice.deploy.registry`). A stack: per model the policy the running routers report,
replicas, routers, HAProxy's server map, ingress, canary; given a file, where it differs. `ready` or `degraded` with
the reasons; `--json` for tools. Details: `sluice/deploy/README.md`.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from base.contracts import SERVED_RANK_HEADER
from builders.plan import PlannedModel, StackPlan, build_plan
from builders.specs import load_spec, parse_spec
from infra.haproxy.canary import legacy_backend
from routers.registry import policy_entry, policy_names
from routers.shadows import SHADOWS_KEY, shadow_lines
from services.internal_credential import internal_headers
from services.replica.middleware.remote_prefill import PREFILL_REQUESTS_METRIC
from sluice.deploy import registry
from sluice.deploy.apply import frontend_status, stack_name
from sluice.deploy.json_reports import StackList, StackState, StatusReport, canary_state
from sluice.deploy.orphans import orphan_lines, orphans
from sluice.deploy.platforms import is_platform_record, show_platform
from sluice.deploy.preflight import cluster_spans_nodes
from topologies.spec import StackBase

# A decode replica's count of the requests it served by prefill replica and outcome
# (services.replica.middleware.remote_prefill).
_PREFILL_SAMPLE = re.compile(rf"^{PREFILL_REQUESTS_METRIC}_total\{{([^}}]*)\}} (\S+)$", re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def degraded_reasons(spec: StackBase, plan: StackPlan, report: dict[str, Any]) -> list[str]:
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
        roles |= model.app_roles  # as the model's kind describes its LLM apps
    return roles


def model_line(model: PlannedModel, routers: dict[str, Any] | None = None) -> str:
    """A model's policy: as its running routers report it (`routers`), else as planned."""
    running = routers or {"policy": model.policy, "policy_kwargs": {}, "prefill_policy": model.prefill_policy}
    kwargs = f" {running['policy_kwargs']}" if running["policy_kwargs"] else ""
    if model.prefill_app is not None:
        policy = f"decode policy {running['policy']}{kwargs}, prefill policy {running['prefill_policy']}"
    else:
        policy = f"policy {running['policy']}{kwargs}"
    if routers is None:
        policy += " (planned: no router answers)"
    line = f"  model {model.name}: {policy}, HAProxy backends {model.replica_backend} + {model.router_backend}"
    # The running policy's own report, printed as its registry entry says (a policy this CLI does not know: none).
    report = policy_entry(running["policy"]).report if routers and running["policy"] in policy_names() else None
    if report is not None and routers and routers.get(report.key):
        line += "".join(f"\n    {text}" for text in report.lines(routers[report.key]))
    if routers and routers.get(SHADOWS_KEY):
        line += "".join(f"\n    {text}" for text in shadow_lines(routers[SHADOWS_KEY]))
    return line


def prefill_pairs(metrics_text: str) -> dict[tuple[str, str], float]:
    """(prefill replica, outcome) -> requests, from a decode replica's /metrics."""
    pairs: dict[tuple[str, str], float] = {}
    for labels, value in _PREFILL_SAMPLE.findall(metrics_text):
        named = dict(_LABEL.findall(labels))
        key = (named.get("prefill_replica", ""), named.get("outcome", ""))
        pairs[key] = pairs.get(key, 0.0) + float(value)
    return pairs


def _gang_rank(model: PlannedModel, endpoint: Any) -> int | None:
    """The DP rank a `ranks` replica answers as (None when it does not answer)."""
    try:
        response = httpx.get(f"{endpoint.url}/{model.llm_app}/v1/models", timeout=5, headers=internal_headers())
    except httpx.HTTPError:
        return None
    rank = response.headers.get(SERVED_RANK_HEADER, "")
    return int(rank) if rank.isdigit() else None


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


def routers_report(model: PlannedModel) -> dict[str, Any] | None:
    """The policy the model's running routers report (None: no router answers)."""
    from ray import serve

    try:
        return serve.get_app_handle(model.router_app).describe.remote().result(timeout_s=10)
    except Exception:  # not deployed, or no router replica running
        return None


def differences(
    file_spec: StackBase, file_plan: StackPlan, running_spec: StackBase, running_plan: StackPlan
) -> list[str]:
    """Where a spec file and the running stack differ, in the file's terms."""
    pairs: list[tuple[str, Any, Any]] = [
        ("models", [m.name for m in file_plan.models], [m.name for m in running_plan.models]),
        ("routing.policy_kwargs", file_spec.routing.policy_kwargs, running_spec.routing.policy_kwargs),
        ("ingress.mode", file_spec.ingress.mode, running_spec.ingress.mode),
        ("ingress.direct_weight", file_spec.ingress.direct_weight, running_spec.ingress.direct_weight),
    ]
    for mine, theirs in zip(file_plan.models, running_plan.models, strict=False):
        for field in ("policy", "prefill_policy", "min_replicas", "routers", "legacy_deployed"):
            pairs.append((f"{mine.name}: {field}", getattr(mine, field), getattr(theirs, field)))
    return [f"{what} {mine} in the file, {theirs} running" for what, mine, theirs in pairs if mine != theirs]


def canary_line(ingress: dict[str, Any] | None) -> str | None:
    """The canary's state in words (None: no canary runs and none rolled back)."""
    if ingress is None:
        return None
    abort = ingress.get("abort")
    if abort is not None:
        breach = abort["breach"]
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(abort["at"]))
        return (
            f"canary ROLLED BACK by itself at {when} from weight {abort['weight_before']}% to 0%: {abort['app']}: "
            f"{breach['criterion']} measured {breach['value']:.3f} over its limit {breach['threshold']:.3f}"
        )
    weight = ingress["direct_weight"]
    if 0 < weight < 100:
        return f"canary running: {weight}% of sessions on the direct path"
    return None


def list_stacks(as_json: bool) -> int:
    """Every stack on the cluster, and the processes on this node that outlived their replica."""
    from ray import serve

    applications = serve.status().applications
    stacks = []
    for entry in registry.deployed_stacks():
        states = {app: applications[app].status.value if app in applications else "NOT_DEPLOYED" for app in entry.apps}
        stacks.append({"stack": entry.stack, "source": entry.source, "deployed_at": entry.deployed_at, "apps": states})
    left = orphans()
    if as_json:
        print(StackList.model_validate({"stacks": stacks, "orphans": left}).model_dump_json(indent=2))
        return 0
    if not stacks:
        print("no sluice stack on this cluster")
    for stack in stacks:
        running = sum(state == "RUNNING" for state in stack["apps"].values())
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stack["deployed_at"]))
        apps = f"{running} of {len(stack['apps'])} apps RUNNING"
        print(f"{stack['stack']}: {apps}, deployed {when} from {stack['source']}")
    for line in orphan_lines(left):
        print(line)
    return 0


def _running_stack(target: str) -> tuple[Any, StackPlan, list[str], str] | None:
    """The running stack's spec and plan, where `target` (a file) differs from it, and what the report is read
    from; None: no such stack."""
    spans_nodes = cluster_spans_nodes()
    file_spec = load_spec(target) if Path(target).is_file() else None
    entry = registry.deployed(file_spec.stack if file_spec is not None else target)
    if entry is None:
        if file_spec is None:
            return None
        plan = build_plan(file_spec, spans_nodes=spans_nodes)
        return file_spec, plan, [], "the file: the cluster has no record of this stack's deployment"
    spec = parse_spec(entry.spec, entry.source)
    plan = build_plan(spec, spans_nodes=spans_nodes)
    recorded = f"the deployment record ({entry.source})"
    if file_spec is None:
        return spec, plan, [], recorded
    return spec, plan, differences(file_spec, build_plan(file_spec, spans_nodes=spans_nodes), spec, plan), recorded


def status(target: str | None, address: str, as_json: bool = False) -> int:
    from sluice.deploy.preflight import connect

    connect(address)
    if target is None:
        return list_stacks(as_json)
    recorded = registry.deployed(stack_name(target) if Path(target).is_file() else target)
    if recorded is not None and is_platform_record(recorded):
        return show_platform(recorded, as_json)
    found = _running_stack(target)
    if found is None:
        known = ", ".join(e.stack for e in registry.deployed_stacks()) or "none"
        print(f"no sluice stack {target!r} on this cluster (deployed: {known})", file=sys.stderr)
        return 1
    spec, plan, differ, described_from = found
    from ray import serve

    from services.serve_internals import list_replica_endpoints

    applications = serve.status().applications
    report: dict[str, Any] = {"stack": plan.stack, "apps": {}, "pairs": {}, "models": {}, "differences": differ}
    report["described_from"] = described_from
    roles = app_roles(plan)
    endpoints_of = {}
    for app in plan.apps:
        state = applications.get(app.name)
        endpoints_of[app.name] = asyncio.run(list_replica_endpoints(app.name)) if state is not None else []
        report["apps"][app.name] = {
            "role": roles[app.name],
            "status": state.status.value if state is not None else "NOT_DEPLOYED",
            "replicas": [{"id": e.replica_id, "host": e.host, "port": e.port} for e in endpoints_of[app.name]],
        }
    for model in plan.models:
        report["models"][model.name] = {"routers": routers_report(model), "planned_policy": model.policy}
        if model.prefill_app is not None:
            report["pairs"][model.name] = _pairs_report(model, endpoints_of[model.llm_app])
        if model.data_parallel == "ranks":
            ranked = zip(report["apps"][model.llm_app]["replicas"], endpoints_of[model.llm_app], strict=True)
            for replica, endpoint in ranked:
                replica["rank"] = _gang_rank(model, endpoint)
    report["frontend"] = frontend_status(plan)
    ingress = ingress_state(plan) if report["frontend"] else None
    report["ingress"] = {"mode": spec.ingress.mode, **(ingress or {})}
    report["canary"] = {
        "state": canary_state(ingress),
        "direct_weight": ingress["direct_weight"] if ingress else None,
        "summary": canary_line(ingress),
    }
    reasons = degraded_reasons(spec, plan, report)
    ready = not reasons
    report.update(state=StackState.READY if ready else StackState.DEGRADED, reasons=reasons)
    if as_json:
        print(StatusReport.model_validate(report).model_dump_json(indent=2))
        return 0 if ready else 1
    print(f"{report['stack']}: {'ready' if ready else 'degraded: ' + '; '.join(reasons)}")
    print(f"  described from {described_from}")
    if report["canary"]["summary"]:
        print(f"  {report['canary']['summary']}")
    for line in differ:
        print(f"  differs: {line}")
    for model in plan.models:
        print(model_line(model, report["models"][model.name]["routers"]))
        for pair in report["pairs"].get(model.name, []):
            print(
                f"    pair decode {pair['decode']} <- prefill {pair['prefill'] or '-'}: "
                f"{pair['outcome']} {pair['requests']:.0f}"
            )
    for name, app_report in report["apps"].items():
        print(f"  app {name} ({app_report['role']}): {app_report['status']}")
        for replica in app_report["replicas"]:
            rank = f" rank {replica['rank'] if replica['rank'] is not None else '?'}" if "rank" in replica else ""
            print(f"    replica {replica['id']} {replica['host']}:{replica['port']}{rank}")
    frontend = report["frontend"] or {}
    if frontend.get("running"):
        print(f"  ingress mode {spec.ingress.mode}: direct weight {frontend['direct_weight']}%")
        print(f"  HAProxy {frontend['url']} (master {frontend['master_pid']}, restarts {frontend['restarts']}):")
        for server in frontend["servers"]:
            print(f"    {server['backend']}/{server['server']} {server['addr']} {server['status']}")
    return 0 if ready else 1


def ingress_state(plan: StackPlan) -> dict[str, Any] | None:
    from ray import serve

    try:
        ingress = serve.get_app_handle(plan.frontend_app).ingress.remote().result(timeout_s=10)
    except Exception:  # the frontend replica is restarting
        return None
    return {key: ingress[key] for key in ("direct_weight", "declared_weight", "abort")}
