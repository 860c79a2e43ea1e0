"""`sluice deploy | down | render`: a team's stack on a running Ray cluster, from its spec file.

`deploy` runs the preflight, submits the plan's apps and follows them (`sluice.deploy.progress`) until the frontend
has every replica UP, then returns: the stack lives in the cluster, recorded there (`sluice.deploy.registry`). A
failed deployment or the deadline (`--timeout`) ends it with exit 1 and the reason. Details: `sluice/deploy/README.md`.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from base.contracts import DIRECT_WEIGHT_MAX
from base.waiting import WaitTimeout, wait_until
from builders.plan import StackPlan, build_plan, model_path, serve_config
from builders.platform import build_platform_plan
from builders.specs import load_spec
from services.frontend.ingress_control import forget_ingress
from sluice.deploy import registry
from sluice.deploy.platforms import attached_lines, check_attachment, deploy_platform, detach, wait_attached
from sluice.deploy.preflight import cluster_spans_nodes, connect, preflight, replica_demands
from sluice.deploy.progress import DeployProgress
from topologies.platform import is_platform_file, load_platform
from topologies.spec import TINY_MOE_SOURCE, TINY_SOURCE, StackBase

logger = logging.getLogger(__name__)

# Sized for a model load: the tiny model on CPU starts in ~30 s, a real model on GPUs in minutes.
CPU_DEPLOY_TIMEOUT_S = 600.0
GPU_DEPLOY_TIMEOUT_S = 1800.0
_POLL_S = 0.5
# Deleting apps together: their replicas drain at once (5 s each at least), a stopping vLLM engine takes ~5 s more.
DELETE_TIMEOUT_S = 120.0


def plan_of(path: str) -> tuple[Any, StackPlan]:
    """A team file's or a platform file's spec and plan."""
    if is_platform_file(path):
        platform = load_platform(path)
        return platform, build_platform_plan(platform)
    spec = load_spec(path)
    return spec, build_plan(spec)


def render(path: str) -> str:
    _, plan = plan_of(path)
    header = f"# Rendered by `sluice render {path}`: deploy with `serve deploy`, or as KubeRay's serveConfigV2.\n"
    return header + yaml.safe_dump(serve_config(plan), sort_keys=False)


def default_timeout_s(plan: StackPlan) -> float:
    """How long `deploy` waits by default: a GPU model load when any replica asks for a GPU."""
    gpus = any(one.get("GPU", 0.0) > 0 for _, one, _ in replica_demands(plan))
    return GPU_DEPLOY_TIMEOUT_S if gpus else CPU_DEPLOY_TIMEOUT_S


def quiet_ray_loggers(verbose: bool) -> None:
    """Ray's and Serve's own lines stay out of a command's output unless `--verbose` (after Ray's import, which
    configures its loggers)."""
    import ray  # noqa: F401

    level = logging.INFO if verbose else logging.ERROR
    for name in ("ray", "ray.serve"):
        logging.getLogger(name).setLevel(level)


def frontend_status(plan: StackPlan, timeout_s: float = 10.0) -> dict[str, Any] | None:
    """The frontend's own report (HAProxy's servers and PIDs, the ingress, the routers it publishes to), or None while
    it does not answer: the one reader `sluice status`, `sluice check` and the soak share."""
    from ray import serve

    try:
        return serve.get_app_handle(plan.frontend_app).status.remote().result(timeout_s=timeout_s)
    except Exception:  # not deployed, or not running yet
        return None


def frontend_url(plan: StackPlan) -> str:
    """Where the deployed frontend listens, as it reports it: the head node's address on a stack across nodes."""
    status = frontend_status(plan)
    return status["url"] if status and status.get("url") else plan.url


def ensure_models(spec: StackBase) -> None:
    """Build the tiny model if a model of the spec is `tiny` and it is not built yet."""
    from base.tiny_model import ensure_built

    sources = {model.source for model in spec.models}
    for source, moe in ((TINY_SOURCE, False), (TINY_MOE_SOURCE, True)):
        if source in sources:
            ensure_built(Path(model_path(source)), moe)


def _routerless_backends(plan: StackPlan, status: dict[str, Any]) -> list[str]:
    """The models' router backends with no server UP in the frontend's report."""
    backends_up = {server["backend"] for server in status["servers"] if server["status"] == "UP"}
    return [model.router_backend for model in plan.models if model.router_backend not in backends_up]


def _published(plan: StackPlan) -> bool:
    """Whether every app runs its new version (a redeploy reports DEPLOYING until it does) and the frontend has every
    model's replicas UP and published to its routers, and a router of each model UP (route calls go to it)."""
    from ray import serve

    applications = serve.status().applications
    if any(app.name not in applications or applications[app.name].status.value != "RUNNING" for app in plan.apps):
        return False
    status = frontend_status(plan)
    wanted = [model.min_replicas for model in plan.models]
    if not status or not status["running"] or len(status["published"]) != len(wanted):
        return False
    if _routerless_backends(plan, status):
        return False
    return all(published >= n for published, n in zip(status["published"], wanted, strict=True))


def _frontend_lag(plan: StackPlan) -> str:
    """What the frontend still lacks: not running, or each model's replicas published and servers not UP."""
    status = frontend_status(plan)
    if not status or not status["running"]:
        return "the frontend's HAProxy is not running (or the frontend does not answer)"
    not_up = [f"{s['backend']}/{s['server']} {s['status']}" for s in status["servers"] if s["status"] != "UP"]
    published = ", ".join(
        f"{model.name} {n} of {model.min_replicas} replicas published"
        for model, n in zip(plan.models, status["published"], strict=False)
    )
    no_router = _routerless_backends(plan, status)
    return (
        f"the frontend has not every replica UP in HAProxy yet: {published or 'nothing published'}; "
        f"servers not UP: {', '.join(not_up) or 'none'}; "
        f"router backends with no router UP: {', '.join(no_router) or 'none'}"
    )


def apply_plan(spec: StackBase, plan: StackPlan, timeout_s: float | None = None, source: str = "sluice serve") -> bool:
    """Deploy the plan's apps in order and record the stack; show each deployment's replicas as they start, until
    the frontend has every replica UP (True), a deployment failed or the deadline passed (False, said why)."""
    from ray import serve

    started = time.monotonic()
    deadline = started + (default_timeout_s(plan) if timeout_s is None else timeout_s)

    def say(line: str) -> None:
        print(f"[{time.monotonic() - started:5.1f} s] {line}", flush=True)

    targets = []
    for app in plan.apps:
        module, name = app.import_path.split(":")
        builder = getattr(importlib.import_module(module), name)
        targets.append(serve.RunTarget(builder(app.args), name=app.name, route_prefix=app.route_prefix))
    # Serve's own wait for an app to run has no deadline: submit every app, then follow them here.
    previous = registry.deployed(plan.stack)
    if previous is None:
        registry.record(spec, plan, source)
    else:
        registry.add_apps(plan.stack, [app.name for app in plan.apps])
    serve.run_many(targets, wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
    say(f"deploying {', '.join(app.name for app in plan.apps)}")
    progress = DeployProgress([app.name for app in plan.apps], say)

    def settled() -> tuple[str | None] | None:
        """(Serve's failure,) once a deployment failed, (None,) once the frontend published every replica."""
        failed = progress.poll()
        return (failed,) if failed is not None or _published(plan) else None

    try:
        (failed,) = wait_until(deadline - time.monotonic(), settled, "the stack", poll_s=_POLL_S)
    except WaitTimeout:
        stuck = progress.stuck() or [f"{plan.frontend_app}: {_frontend_lag(plan)}"]
        waited = time.monotonic() - started
        print(f"\ndeploy timed out after {waited:.0f} s; still not ready:\n" + "\n".join(stuck), file=sys.stderr)
        return False
    if failed is not None:
        print(f"\ndeploy failed: Serve gave up on a deployment:\n{failed}", file=sys.stderr)
        return False
    for model in plan.models:
        say(f"frontend: {model.name}: {model.min_replicas} replica(s) UP and published to its routers")
    settle_ingress(spec, plan, say)
    registry.record(spec, plan, source)
    retired = registry.retired_apps(previous, plan)
    if retired:
        delete_apps(retired, frontend_first=False)
    return True


def settle_ingress(spec: StackBase, plan: StackPlan, say: Callable[[str], None]) -> None:
    """Wait for the declared ingress: the frontend holding this declaration (its weight in force, or a run-time
    weight `sluice canary`/`rollback` set over the same declaration, which a redeploy keeps), a path that lost its
    traffic drained; then remove a legacy ingress the spec no longer retains, once no request goes there."""
    from ray import serve

    frontend = serve.get_app_handle(plan.frontend_app)
    latest: dict[str, Any] = {}

    def drained() -> bool:
        drain = latest.get("drain")
        return drain is None or drain["done"] or bool(drain["still_running"])

    def settled() -> bool:
        try:
            latest.update(frontend.ingress.remote().result(timeout_s=30))
        except Exception as error:  # noqa: BLE001 - the frontend busy or restarting: not settled yet
            logger.debug("the frontend's ingress did not answer: %r", error)
            return False
        return latest["declared_weight"] == spec.ingress.direct_weight and drained()

    with contextlib.suppress(WaitTimeout):
        wait_until(spec.ingress.drain_deadline_s + 30, settled, "the declared ingress", poll_s=0.2)
    if not latest:
        say("frontend: its ingress did not answer; the legacy path, if any, is left as it is")
        return
    weight, drain = latest["direct_weight"], latest["drain"]
    kept = (
        ""
        if weight == spec.ingress.direct_weight
        else f" (a run-time weight over the declared {spec.ingress.direct_weight}%)"
    )
    say(f"frontend: direct weight {weight}%{kept} (ingress mode {spec.ingress.mode})")
    if drain is not None:
        state = "drained" if drain["done"] else f"still streaming at the deadline: {drain['still_running']}"
        say(f"frontend: the {drain['path']} path {state}")
    unused = weight == DIRECT_WEIGHT_MAX and drained()
    for model in plan.models:
        if model.legacy_app and not model.legacy_deployed and model.legacy_app in serve.status().applications:
            if not unused:
                say(f"{model.legacy_app}: kept (the spec retains no legacy path, but requests still go there)")
                continue
            serve.delete(model.legacy_app)
            say(f"{model.legacy_app}: deleted (the spec retains no legacy path)")


def serving_lines(spec: StackBase, plan: StackPlan) -> list[str]:
    if spec.frontend.attached:
        return attached_lines(spec, plan)
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


def delete_apps(
    apps: list[str], frontend_first: bool = True, timeout_s: float = DELETE_TIMEOUT_S, wait: bool = True
) -> None:
    """Delete a stack's apps: the frontend (the last app) first and to the end, so nothing is routed to an app that is
    going away (`frontend_first`); then the others together, so their replicas' draining periods (Serve keeps each for
    at least `RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S`) overlap instead of adding up. `wait` False: every
    delete is only issued, the frontend's first, and Serve drains them while the caller goes on (a test's teardown,
    where no request is sent any more and a later stack has names of its own). The apps' capacity ledgers (detached
    actors) are ended with them."""
    from ray import serve

    from routers.ledger_actor import end_ledgers

    existing = serve.status().applications
    rest = [app for app in reversed(apps) if app in existing]
    if rest and frontend_first and wait:
        first = rest.pop(0)
        serve.delete(first)
        print(f"deleted {first}", flush=True)
    for app in rest:
        serve.delete(app, _blocking=False)
    for ledger in end_ledgers(apps):  # detached: they would outlive the stack
        print(f"ended {ledger}", flush=True)
    if not wait:
        return

    def gone() -> bool:
        return not set(rest) & set(serve.status().applications)

    wait_until(timeout_s, gone, f"Serve to delete {', '.join(rest)}", poll_s=_POLL_S)
    for app in rest:
        print(f"deleted {app}", flush=True)


def delete_plan(plan: StackPlan, wait: bool = True) -> None:
    delete_apps([app.name for app in plan.apps], wait=wait)


def deploy(path: str, address: str, timeout_s: float | None = None) -> int:
    from ray import serve

    if is_platform_file(path):
        return deploy_platform(path, address, timeout_s)
    spec = load_spec(path)
    connect(address)
    spans_nodes = cluster_spans_nodes()
    plan = build_plan(spec, spans_nodes=spans_nodes)
    start_serve = preflight(plan, spans_nodes, spec.frontend.listening_ports())
    if spec.frontend.attached:
        check_attachment(spec, list(serve.status().applications))
    ensure_models(spec)
    if start_serve is not None:
        serve.start(**start_serve)
    if spans_nodes:
        print("a cluster of sluice nodes: LLM replicas on the worker nodes, the frontend on the head", flush=True)
    if not apply_plan(spec, plan, timeout_s, source=str(Path(path).resolve())):
        return 1
    url = wait_attached(spec) if spec.frontend.attached else frontend_url(plan)
    plan = plan.model_copy(update={"url": url})
    print("\n".join(serving_lines(spec, plan)))
    return 0


def down(target: str, address: str) -> int:
    """Delete a stack, named by its spec file or its name (`team-name`), and forget it."""
    connect(address)
    stack = stack_name(target) if Path(target).is_file() else target
    entry = registry.deployed(stack)
    if entry is not None:
        apps = entry.apps
    elif Path(target).is_file():
        apps = [app.name for app in plan_of(target)[1].apps]
    else:
        known = ", ".join(e.stack for e in registry.deployed_stacks()) or "none"
        print(f"no sluice stack {stack!r} on this cluster (deployed: {known})", file=sys.stderr)
        return 1
    delete_apps(apps)
    if entry is not None:
        detach(stack, entry.spec)
    registry.forget(stack)
    forget_ingress(stack)
    return 0


def stack_name(path: str) -> str:
    """The stack a spec file or a platform file deploys."""
    return load_platform(path).stack if is_platform_file(path) else load_spec(path).stack
