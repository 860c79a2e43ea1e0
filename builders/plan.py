"""A spec becomes a plan: the Ray Serve applications of a stack, each named by its builder's import path and args.

The same plan is deployed by `sluice deploy` (one `serve.run` per app) and rendered as a Serve config file
(`sluice render`) in the schema of `serve deploy` and KubeRay's `serveConfigV2`: both build the same apps.
An `openai` stack with one model is three apps: the model's LLM app (its replicas serve vLLM's paths under the
app's route prefix, which the frontend prepends), its router app, and the frontend app (HAProxy, its syncer,
its key watcher). Several models behind one frontend, and the data-parallel and prefill/decode kinds, are
refused here with the reason until their builders exist.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from base.runtime import default_model_dir
from infra.haproxy_config import AppRoute
from services.frontend_app import FrontendArgs, build_frontend_application
from services.llm_config import LLMAppConfig, ReplicaDeploymentConfig
from services.llm_replica import build_llm_application
from services.router_service import RouterAppArgs, RouterSettings, build_router_application
from topologies.problems import SpecError, SpecProblem
from topologies.spec import TINY_SOURCE, OpenAIStack, StackBase


class ServeApp(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    route_prefix: str | None
    import_path: str
    args: dict[str, Any]


class StackPlan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    stack: str
    apps: list[ServeApp]
    url: str

    @property
    def frontend_app(self) -> str:
        return self.apps[-1].name


def import_path(builder: Callable[..., Any]) -> str:
    return f"{builder.__module__}:{builder.__name__}"


def model_path(source: str) -> str:
    """Where a model's weights are: the tiny model's folder for `tiny`, else the source as vLLM takes it."""
    return str(default_model_dir()) if source == TINY_SOURCE else source


def build_plan(spec: StackBase) -> StackPlan:
    if not isinstance(spec, OpenAIStack):
        raise SpecError(spec.name, [SpecProblem("kind", f"{spec.kind} stacks have no builder yet: use kind openai")])
    if len(spec.models) != 1:
        problem = SpecProblem("models", "several models behind one frontend are not deployable yet: list one model")
        raise SpecError(spec.name, [problem])
    (model,) = spec.models
    stack = f"{spec.team}-{spec.name}"
    llm_app, router_app = f"{stack}-llm", f"{stack}-router"
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
    frontend = spec.frontend
    route = AppRoute(
        name=llm_app,
        fail_open=routing.fail_mode == "open",
        forward_body=routing.forward_body,
        body_buffer_bytes=routing.body_buffer_bytes,
        session_header=routing.session_header,
        router_route_prefix=f"/{router_app}",
        replica_route_prefix=f"/{llm_app}",
    )
    haproxy = {
        "app": route.model_dump(mode="json"),
        "port": frontend.port,
        "prometheus_port": frontend.metrics_port,
        "route_timeout_s": routing.route_timeout_s,
        "protection": frontend.protection.model_dump(mode="json"),
    }
    frontend_args = FrontendArgs(stack=stack, llm_app=llm_app, router_app=router_app, haproxy=haproxy)
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
        ServeApp(
            name=f"{stack}-frontend",
            route_prefix=None,
            import_path=import_path(build_frontend_application),
            args=frontend_args.model_dump(mode="json"),
        ),
    ]
    return StackPlan(stack=stack, apps=apps, url=f"http://127.0.0.1:{frontend.port}")


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
