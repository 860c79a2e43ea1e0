"""A spec becomes a plan: the Ray Serve applications of a stack, each named by its builder's import path and args.

The same plan is deployed by `sluice deploy` (one `serve.run` per app) and rendered as a Serve config file
(`sluice render`, the schema of `serve deploy` and KubeRay's `serveConfigV2`). Per model its kind's apps
(`builders/kinds/`, asked through the kind registry), then one frontend app for all of them; a plan across nodes
(`spans_nodes`) puts the LLM replicas on workers and the rest on the head. Details: docs/design.md §2.2.
"""

from __future__ import annotations

import re
from typing import Any

from base.contracts import STAGING_SERVER_TIMEOUT_S
from base.runtime import LOOPBACK
from builders.kinds.registry import kind_of
from builders.plan_types import PlannedModel, ServeApp, StackPlan, import_path, model_path
from infra.haproxy.apps import AppRoute
from services.frontend.app import (
    FRONTEND_DEPLOYMENT_NAME,
    AttachedApp,
    Attachment,
    FrontendArgs,
    ServedApp,
    build_frontend_application,
)
from services.legacy.ingress import build_legacy_ingress_application
from services.router.service import build_router_application
from topologies.problems import SpecError, SpecProblem
from topologies.spec import StackBase

__all__ = ["PlannedModel", "ServeApp", "StackPlan", "build_plan", "model_path", "serve_config"]


def frontend_app_name(stack: str) -> str:
    return f"{stack}-frontend"


def app_stem(stack: str, model: str, several: bool) -> str:
    """The stem of a model's Serve app names: the stack's, or with several models the stack's and the model's."""
    if not several:
        return stack
    return f"{stack}-" + re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")


def build_plan(spec: StackBase, spans_nodes: bool = False) -> StackPlan:
    """The plan of any kind: each model's apps (its kind's `model_apps`), then the one frontend app; `spans_nodes`:
    each app placed on its role's nodes."""
    stack = spec.stack
    several = len(spec.models) > 1
    stems: dict[str, int] = {}
    problems = []
    for i, model in enumerate(spec.models):
        stem = app_stem(stack, model.name, several)
        if stem in stems:
            message = f"{model.name!r} gets the same app names as models[{stems[stem]}]: rename one"
            problems.append(SpecProblem(f"models[{i}].name", message))
        stems.setdefault(stem, i)
    if problems:
        raise SpecError(spec.name, problems)
    kind = kind_of(spec)
    apps: list[ServeApp] = []
    routes: list[AppRoute] = []
    models: list[PlannedModel] = []
    for index, (model, stem) in enumerate(zip(spec.models, stems, strict=True)):
        model_apps, route, planned = kind.model_apps(spec, index, model, stem)
        apps += model_apps
        routes.append(route)
        models.append(planned)
    frontend = spec.frontend
    haproxy = {
        "apps": [route.model_dump(mode="json") for route in routes],
        "model_lookup_bytes": spec.routing.body_buffer_bytes,
        "port": frontend.port,
        "prometheus_port": frontend.metrics_port,
        "route_timeout_s": spec.routing.route_timeout_s,
        "protection": frontend.protection.model_dump(mode="json"),
        "tls": frontend.tls.model_dump(mode="json") if frontend.tls else None,
        "staging_server_timeout_s": STAGING_SERVER_TIMEOUT_S if spec.staging else None,
        "attached": frontend.attached,
        "tracing": spec.observability.tracing.enabled,
    }
    served = [
        ServedApp(llm_app=model.llm_app, router_app=model.router_app, legacy_app=model.legacy_app) for model in models
    ]
    attachment = _attachment(spec, apps, models) if frontend.attached else None
    frontend_args = FrontendArgs(
        stack=stack, apps=served, haproxy=haproxy, ingress=spec.ingress.config(), attachment=attachment
    )
    apps.append(
        ServeApp(
            name=frontend_app_name(stack),
            route_prefix=None,
            import_path=import_path(build_frontend_application),
            args=frontend_args.model_dump(mode="json"),
        )
    )
    if spans_nodes:
        apps = [_placed(app) for app in apps]
    return StackPlan(
        stack=stack, apps=apps, models=models, url=f"{'https' if frontend.tls else 'http'}://{LOOPBACK}:{frontend.port}"
    )


def _attachment(spec: StackBase, apps: list[ServeApp], models: list[PlannedModel]) -> Attachment:
    """What the platform needs of an attached stack: each model and what one replica of its pinned app takes."""
    by_name = {app.name: app for app in apps}
    capacities = [by_name[model.llm_app].args["deployment"]["max_ongoing_requests"] for model in models]
    assert spec.frontend.platform is not None
    return Attachment(
        platform=spec.frontend.platform,
        team=spec.team,
        apps=[
            AttachedApp(model=model.name, max_ongoing_requests=capacity)
            for model, capacity in zip(models, capacities, strict=True)
        ],
    )


# Where each kind of app runs on a stack across nodes; an LLM app's role is its deployment's.
_HEAD_APPS = {import_path(b) for b in (build_router_application, build_legacy_ingress_application)} | {
    import_path(build_frontend_application)
}


def _placed(app: ServeApp) -> ServeApp:
    if app.import_path in _HEAD_APPS:
        return app.model_copy(update={"args": {**app.args, "node_role": "head"}})
    deployment = {**app.args["deployment"], "node_role": "worker"}
    return app.model_copy(update={"args": {**app.args, "deployment": deployment}})


def _serve_config_app(app: ServeApp, frontend: bool) -> dict[str, Any]:
    entry = {"name": app.name, "route_prefix": app.route_prefix, "import_path": app.import_path, "args": app.args}
    if frontend:
        # The declared ingress is the Frontend deployment's user_config: changing it reconfigures the running replica.
        args = dict(app.args)
        ingress = args.pop("ingress")
        entry |= {"args": args, "deployments": [{"name": FRONTEND_DEPLOYMENT_NAME, "user_config": ingress}]}
    return entry


def serve_config(plan: StackPlan) -> dict[str, Any]:
    """The plan as a Serve config file (`serve deploy`, KubeRay's `serveConfigV2`), checked with Ray's own schema."""
    from ray.serve.schema import ServeDeploySchema

    frontend = import_path(build_frontend_application)
    config = {"applications": [_serve_config_app(app, app.import_path == frontend) for app in plan.apps]}
    ServeDeploySchema.model_validate(config)
    return config
