"""A spec becomes a plan: the Ray Serve applications of a stack, each named by its builder's import path and args.

The same plan is deployed by `sluice deploy` (one `serve.run` per app) and rendered as a Serve config file
(`sluice render`) in the schema of `serve deploy` and KubeRay's `serveConfigV2`: both build the same apps.
An `openai` stack is, per model, an LLM app (its replicas serve vLLM's paths under the app's route prefix, which
the frontend prepends) and a router app with the model's policy; then one frontend app (HAProxy, its syncer, its
key watcher) for all of them, which picks each request's app by its model when there are several.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from base.runtime import default_model_dir
from infra.haproxy_config import AppRoute, replica_backend, router_backend
from services.frontend_app import FrontendArgs, ServedApp, build_frontend_application
from services.llm_config import LLMAppConfig, ReplicaDeploymentConfig
from services.llm_replica import build_llm_application
from services.router_service import RouterAppArgs, RouterSettings, build_router_application
from topologies.problems import SpecError, SpecProblem
from topologies.spec import TINY_SOURCE, OpenAIModel, OpenAIStack, StackBase


class ServeApp(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    route_prefix: str | None
    import_path: str
    args: dict[str, Any]


class PlannedModel(BaseModel):
    """One served model of a plan: its Serve apps, its HAProxy backends and its policy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    llm_app: str
    router_app: str
    replica_backend: str
    router_backend: str
    policy: str
    # Replicas the stack waits for and expects (the fixed count, or the autoscaling minimum).
    min_replicas: int
    routers: int


class StackPlan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    stack: str
    apps: list[ServeApp]
    models: list[PlannedModel]
    url: str

    @property
    def frontend_app(self) -> str:
        return self.apps[-1].name


def import_path(builder: Callable[..., Any]) -> str:
    return f"{builder.__module__}:{builder.__name__}"


def model_path(source: str) -> str:
    """Where a model's weights are: the tiny model's folder for `tiny`, else the source as vLLM takes it."""
    return str(default_model_dir()) if source == TINY_SOURCE else source


def app_stem(stack: str, model: str, several: bool) -> str:
    """The stem of a model's Serve app names: the stack's, or with several models the stack's and the model's."""
    if not several:
        return stack
    return f"{stack}-" + re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")


def _model_apps(
    spec: OpenAIStack, index: int, model: OpenAIModel, stem: str
) -> tuple[list[ServeApp], AppRoute, PlannedModel]:
    """A model's LLM app and router app, how the frontend routes to them, and what the plan says of them."""
    llm_app, router_app = f"{stem}-llm", f"{stem}-router"
    routing = spec.routing.overridden(model.routing)
    deployment = ReplicaDeploymentConfig(
        num_replicas=model.fixed_replicas,
        autoscaling=model.autoscaling.model_dump() if model.autoscaling else None,
        max_ongoing_requests=model.max_ongoing_requests,
        num_cpus=model.resources.cpus,
        num_gpus=model.resources.gpus,
        accelerator_type=model.resources.accelerator_type,
        capacity_ledger=routing.policy == "capacity_queue",
    )
    llm = LLMAppConfig(engine=model.engine_config(model_path(model.source)), deployment=deployment)
    router = RouterAppArgs(
        settings=RouterSettings(
            target_app=llm_app,
            target_capacity=model.max_ongoing_requests,
            policy=routing.policy,
            policy_kwargs=routing.policy_kwargs,
            session_header=routing.session_header,
        ),
        num_replicas=spec.frontend.routers,
    )
    route = AppRoute(
        name=llm_app,
        model=model.name,
        fail_open=routing.fail_mode == "open",
        forward_body=routing.forward_body,
        body_buffer_bytes=routing.body_buffer_bytes,
        session_header=routing.session_header,
        router_route_prefix=f"/{router_app}",
        replica_route_prefix=f"/{llm_app}",
    )
    apps = [
        ServeApp(
            name=llm_app,
            route_prefix=f"/{llm_app}",
            import_path=import_path(build_llm_application),
            args=llm.model_dump(mode="json"),
        ),
        ServeApp(
            name=router_app,
            route_prefix=f"/{router_app}",
            import_path=import_path(build_router_application),
            args=router.model_dump(mode="json"),
        ),
    ]
    planned = PlannedModel(
        name=model.name,
        llm_app=llm_app,
        router_app=router_app,
        replica_backend=replica_backend(index),
        router_backend=router_backend(index),
        policy=routing.policy,
        min_replicas=model.autoscaling.min_replicas if model.autoscaling else model.fixed_replicas,
        routers=spec.frontend.routers,
    )
    return apps, route, planned


def build_plan(spec: StackBase) -> StackPlan:
    if not isinstance(spec, OpenAIStack):
        raise SpecError(spec.name, [SpecProblem("kind", f"{spec.kind} stacks have no builder yet: use kind openai")])
    stack = f"{spec.team}-{spec.name}"
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
    apps: list[ServeApp] = []
    routes: list[AppRoute] = []
    models: list[PlannedModel] = []
    for index, (model, stem) in enumerate(zip(spec.models, stems, strict=True)):
        model_apps, route, planned = _model_apps(spec, index, model, stem)
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
    }
    served = [ServedApp(llm_app=model.llm_app, router_app=model.router_app) for model in models]
    frontend_args = FrontendArgs(stack=stack, apps=served, haproxy=haproxy)
    apps.append(
        ServeApp(
            name=f"{stack}-frontend",
            route_prefix=None,
            import_path=import_path(build_frontend_application),
            args=frontend_args.model_dump(mode="json"),
        )
    )
    return StackPlan(stack=stack, apps=apps, models=models, url=f"http://127.0.0.1:{frontend.port}")


def serve_config(plan: StackPlan) -> dict[str, Any]:
    """The plan as a Serve config file (`serve deploy`, KubeRay's `serveConfigV2`), checked with Ray's own schema."""
    from ray.serve.schema import ServeDeploySchema

    config = {
        "applications": [
            {"name": app.name, "route_prefix": app.route_prefix, "import_path": app.import_path, "args": app.args}
            for app in plan.apps
        ]
    }
    ServeDeploySchema.model_validate(config)
    return config
