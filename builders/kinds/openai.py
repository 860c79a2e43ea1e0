"""The `openai` kind: each model a set of vLLM replicas behind the shared frontend, its router app choosing among
them with the model's policy, and a legacy ingress app when the stack retains the legacy path.

`replica_model_apps` also plans the data-parallel kind's models (`builders.kinds.data_parallel`), whose replicas are
the same apps with vLLM data parallelism.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from base.contracts import SIM_STAND_IN
from builders.kinds.kind import ModelApps, TopologyKind
from builders.model_apps import (
    legacy_serve_app,
    llm_deployment,
    llm_serve_app,
    min_replicas,
    model_route,
    planned_model,
    router_serve_app,
    router_settings,
    with_kv_events,
)
from builders.plan_types import model_path
from services.replica.llm_config import DataParallelEngine, LLMAppConfig
from topologies.sections import Scaling
from topologies.spec import ModelBase, StackBase

NAME = "openai"


class OpenAIModel(ModelBase, Scaling):
    pass


class OpenAIStack(StackBase):
    kind: Literal["openai"]
    """The topology kind: `openai` (plain OpenAI-compatible replicas)."""
    models: list[OpenAIModel] = Field(min_length=1)
    """The served models, each with its own replicas and router app."""


def replica_model_apps(
    spec: StackBase, index: int, model: OpenAIModel, stem: str, data_parallel: DataParallelEngine | None = None
) -> ModelApps:
    """A model's LLM app and router app (with vLLM data parallelism when `data_parallel` is given), and its legacy
    ingress app when the stack retains the legacy path."""
    llm_app, router_app, legacy_app = f"{stem}-llm", f"{stem}-router", f"{stem}-legacy"
    routing = spec.routing.overridden(model.routing)
    engine = with_kv_events(model.engine_config(model_path(model.source), gpus=model.resources.gpus > 0), routing)
    gang_size = None
    in_engine_ranks = 1
    if data_parallel is not None:
        extra = {**engine.extra_args, "data_parallel_size": data_parallel.size}
        engine = engine.model_copy(update={"extra_args": extra})
        gang_size = data_parallel.size if data_parallel.mode == "ranks" else None
        in_engine_ranks = data_parallel.size if data_parallel.mode == "in_engine" else 1
    llm = LLMAppConfig(
        engine=engine,
        deployment=llm_deployment(model, routing, gang_size),
        data_parallel=data_parallel,
        fault_injection=spec.staging,
        engine_stand_in=SIM_STAND_IN if model.simulated else None,
        tracing=spec.observability.tracing,
    )
    planned = planned_model(
        spec,
        index,
        model,
        llm_app,
        router_app,
        policy=routing.policy,
        min_replicas=min_replicas(model) * (gang_size or 1),
        data_parallel=data_parallel.mode if data_parallel else None,
        data_parallel_size=data_parallel.size if data_parallel else 1,
        legacy_app=legacy_app,
        legacy_deployed=spec.ingress.retains_legacy,
    )
    apps = [
        llm_serve_app(llm_app, llm),
        router_serve_app(
            router_app,
            router_settings(spec, llm_app, model, model, routing, data_parallel_size=in_engine_ranks),
            spec.frontend.routers,
        ),
    ]
    if spec.ingress.retains_legacy:
        apps.append(legacy_serve_app(legacy_app, llm_app, spec.ingress.legacy_replicas))
    return apps, model_route(model, llm_app, router_app, routing, legacy_app), planned


def _model_apps(spec: StackBase, index: int, model: OpenAIModel, stem: str) -> ModelApps:
    return replica_model_apps(spec, index, model, stem)


KIND = TopologyKind(NAME, OpenAIStack, _model_apps)
