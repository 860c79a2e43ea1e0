"""`sluice deploy` of a platform file, and what deploying, removing and showing a stack attached to a platform adds.

A platform deploys as one Serve app (its frontend, `builders.platform`), recorded like a stack; deploy returns once
its HAProxy listens. An attached stack's deploy is refused (exit 3) when its platform does not run or another stack
on it holds one of its model names; once the stack is up, deploy waits until the platform serves its models.
Details: services/platform/README.md.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from base.waiting import WaitTimeout, wait_until
from builders.plan import frontend_app_name
from builders.plan_types import StackPlan
from builders.platform import build_platform_plan
from infra.api_keys import ApiKeyError
from services import attachments
from services.platform.app import build_platform_application
from sluice.deploy import registry
from sluice.deploy.preflight import PreflightError, cluster_spans_nodes, connect, preflight
from topologies.platform import PlatformSpec, load_platform, platform_stack
from topologies.spec import StackBase

# A platform's frontend starts HAProxy only (no model load); an attached stack's models reach the platform within
# a sync or two of its frontend's record.
PLATFORM_START_TIMEOUT_S = 120.0
ATTACH_TIMEOUT_S = 30.0
_POLL_S = 0.25


def platform_handle_status(stack: str, timeout_s: float = 10.0) -> dict[str, Any] | None:
    """The platform frontend's own report, or None while it does not answer."""
    from ray import serve

    try:
        return serve.get_app_handle(frontend_app_name(stack)).status.remote().result(timeout_s=timeout_s)
    except Exception:  # not deployed, or not running yet
        return None


def deploy_platform(path: str, address: str, timeout_s: float | None = None) -> int:
    from ray import serve

    spec = load_platform(path)
    try:
        for tenant in spec.tenants:
            tenant.api_keys.digests()
    except ApiKeyError as error:
        print(f"{path}: {error}", file=sys.stderr)
        return 1
    connect(address)
    spans_nodes = cluster_spans_nodes()
    plan = build_platform_plan(spec, spans_nodes=spans_nodes)
    start_serve = preflight(plan, spans_nodes, spec.frontend.listening_ports())
    if start_serve is not None:
        serve.start(**start_serve)
    started = time.monotonic()
    if not apply_platform(spec, plan, timeout_s or PLATFORM_START_TIMEOUT_S, source=str(Path(path).resolve())):
        return 1
    tenants = ", ".join(tenant.team for tenant in spec.tenants)
    print(f"[{time.monotonic() - started:5.1f} s] platform {spec.name} listening", flush=True)
    print(f"\nplatform {spec.name} serves at {plan.url} (tenants: {tenants})")
    print(f"  attach a team's stack with `frontend: {{platform: {spec.name}}}` in its file, then `sluice deploy` it")
    return 0


def apply_platform(spec: PlatformSpec, plan: StackPlan, timeout_s: float, source: str) -> bool:
    """Submit the platform's app, record it, and wait until its HAProxy listens (False, said why, at the
    deadline)."""
    from ray import serve

    app = plan.apps[0]
    serve.run_many(
        [serve.RunTarget(build_platform_application(app.args), name=app.name, route_prefix=app.route_prefix)],
        wait_for_ingress_deployment_creation=False,
        wait_for_applications_running=False,
    )
    registry.record(spec, plan, source)

    def listening() -> bool:
        """Its app runs the new version (a redeploy reports DEPLOYING until it does) and its HAProxy listens."""
        state = serve.status().applications.get(app.name)
        if state is None or state.status.value != "RUNNING":
            return False
        status = platform_handle_status(spec.stack, timeout_s=5.0)
        return bool(status and status["running"])

    try:
        wait_until(timeout_s, listening, f"platform {spec.name}", poll_s=_POLL_S)
    except WaitTimeout as error:
        print(f"deploy timed out: {error}", file=sys.stderr)
        return False
    return True


def check_attachment(spec: StackBase, running_apps: list[str]) -> None:
    """An attached stack's platform runs, and no other stack on it holds one of its model names."""
    platform = spec.frontend.platform
    assert platform is not None
    stack = platform_stack(platform)
    if registry.deployed(stack) is None or frontend_app_name(stack) not in running_apps:
        raise PreflightError(
            f"no platform {platform!r} runs on this cluster (frontend.platform)",
            "deploy the platform's file first (`sluice deploy <platform file>`), or give the stack its own frontend",
        )
    ours = {model.name for model in spec.models}  # type: ignore[attr-defined]
    for other in attachments.attached(platform):
        clash = sorted(ours & {model.name for model in other.models})
        if other.stack != spec.stack and clash:
            raise PreflightError(
                f"model {clash[0]!r} is already on platform {platform!r}, attached by stack {other.stack!r} "
                f"(team {other.team})",
                "model names are unique on a platform: rename the model (models[].name)",
            )


def wait_attached(spec: StackBase) -> str:
    """Once the platform serves every model of the attached stack: the platform's URL."""
    platform = spec.frontend.platform
    assert platform is not None
    ours = {model.name for model in spec.models}  # type: ignore[attr-defined]
    latest: dict[str, Any] = {}

    def served() -> bool:
        status = platform_handle_status(platform_stack(platform), timeout_s=5.0)
        if not status or not status["running"]:
            return False
        latest.update(status)
        mine = {m["model"] for m in status["models"] if m["stack"] == spec.stack and m["capacity"] > 0}
        return ours <= mine

    wait_until(ATTACH_TIMEOUT_S, served, f"platform {platform} to serve {', '.join(sorted(ours))}", poll_s=_POLL_S)
    return str(latest["url"])


def attached_lines(spec: StackBase, plan: StackPlan) -> list[str]:
    """What `sluice deploy` of an attached stack prints: where its models are served, and how a tenant calls one."""
    served = plan.models[0].name
    return [
        f"\nsluice is serving {', '.join(model.name for model in plan.models)} at {plan.url} "
        f"(platform {spec.frontend.platform}: a tenant's key calls the models the platform file lets it):",
        f"  curl -N {plan.url}/v1/chat/completions -H 'authorization: Bearer <your key>' "
        "-H 'content-type: application/json' \\",
        f'    -d \'{{"model": "{served}", "messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 32, '
        '"stream": true}\'',
    ]


def detach(stack: str, spec: dict[str, Any]) -> None:
    """`sluice down` of a stack attached to a platform: its record goes with it (its frontend's stop deletes it
    too; this covers a frontend that died). Of a platform: the stacks still attached to it are named."""
    platform = spec.get("frontend", {}).get("platform")
    if platform is not None:
        attachments.withdraw(platform, stack)
    if spec.get("kind") == "platform":
        left = [record.stack for record in attachments.attached(spec["name"])]
        if left:
            print(
                f"note: {', '.join(left)} still attach to platform {spec['name']}: their models are unreachable "
                "until the platform is deployed again (or take them down: `sluice down <stack>`)",
                file=sys.stderr,
            )


def is_platform_record(entry: registry.DeployedStack) -> bool:
    return entry.spec.get("kind") == "platform"


def show_platform(entry: registry.DeployedStack, as_json: bool) -> int:
    """`sluice status` of a platform: its tenants, each attached model (team, stack, capacity, in flight, queued)
    and each tenant's live usage, as the platform's frontend reports them; exit 1 while it does not run."""
    import json

    report = platform_handle_status(entry.stack)
    running = bool(report and report["running"])
    if as_json:
        print(
            json.dumps({"stack": entry.stack, "state": "ready" if running else "degraded", **(report or {})}, indent=2)
        )
        return 0 if running else 1
    if not running or report is None:
        print(f"{entry.stack}: degraded: the platform's frontend does not run (or does not answer)")
        return 1
    print(
        f"{entry.stack}: ready, serving at {report['url']} "
        f"(HAProxy master {report['master_pid']}, restarts {report['restarts']})"
    )
    for tenant in report["tenants"]:
        usage = tenant["usage"]
        print(
            f"  tenant {tenant['team']}: models {', '.join(tenant['models']) or 'none'}; {usage['in_flight']} in "
            f"flight, {usage['requests_last_minute']} requests in the last minute ({usage['requests']} in all), "
            f"{usage['queue_timeouts']} queue timeouts, {usage['tokens_last_minute']} tokens in the last minute"
        )
    for model in report["models"]:
        print(
            f"  model {model['model']} (team {model['team']}, stack {model['stack']}) at {model['address']}: "
            f"{model['status']}, capacity {model['capacity']}, {model['in_flight']} in flight, {model['queued']} queued"
        )
    for refused in report["refused"]:
        print(
            f"  not attached: {refused['model']} of {refused['stack']} (the name is another stack's, or no slot free)"
        )
    return 0
