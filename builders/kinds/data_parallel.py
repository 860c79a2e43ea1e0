"""The `data_parallel` kind: an `openai` model's apps with vLLM data parallelism. `in_engine` runs `size` engine ranks
in each replica (one server); `ranks` makes each Serve replica one rank of a gang of `size` that Serve schedules and
restarts together (MoE with expert parallelism; `replicas` counts gangs, and a gang has a fixed size, so no
autoscaling). On KubeRay a gang of ranks takes `size` worker pods per replica.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from builders.kinds.kind import ModelApps, TopologyKind
from builders.kinds.openai import OpenAIModel, replica_model_apps
from services.replica.llm_config import DataParallelEngine
from topologies.problems import SpecProblem
from topologies.sections import Scaling, Section
from topologies.spec import StackBase

NAME = "data_parallel"


class DataParallel(Section):
    mode: Literal["in_engine", "ranks"]
    """`in_engine`: one engine runs `size` ranks; `ranks`: each rank its own replica, scheduled as a gang."""
    size: int = Field(ge=2, le=64)
    """Data-parallel ranks per replica (or per gang)."""


class DataParallelModel(OpenAIModel):
    data_parallel: DataParallel
    """vLLM data parallelism: `mode` and `size`."""


class DataParallelStack(StackBase):
    kind: Literal["data_parallel"]
    """The topology kind: `data_parallel` (vLLM data parallelism per replica)."""
    models: list[DataParallelModel] = Field(min_length=1)
    """The served models, each with its data-parallel ranks."""


def _problems(spec: DataParallelStack, index: int, model: DataParallelModel) -> list[SpecProblem]:
    if model.simulated:
        return [
            SpecProblem(f"models[{index}].engine", "the simulator engine has no data parallel ranks: use kind openai")
        ]
    if model.data_parallel.mode == "ranks" and model.autoscaling:
        message = "data_parallel mode `ranks` is a gang of fixed size: give replicas (gangs), not autoscaling"
        return [SpecProblem(f"models[{index}].autoscaling", message)]
    return []


def _model_apps(spec: DataParallelStack, index: int, model: DataParallelModel, stem: str) -> ModelApps:
    engine = DataParallelEngine(mode=model.data_parallel.mode, size=model.data_parallel.size)
    apps, route, planned = replica_model_apps(spec, index, model, stem, engine)
    if engine.mode == "in_engine":
        role = f"replicas of {model.name}, {engine.size} engine ranks each"
    else:
        role = f"rank replicas of {model.name}, gangs of {engine.size}"
    return apps, route, planned.model_copy(update={"app_roles": {planned.llm_app: role}})


def _llm_deployments(model: DataParallelModel) -> list[tuple[Scaling, int]]:
    return [(model, model.data_parallel.size if model.data_parallel.mode == "ranks" else 1)]


KIND = TopologyKind(NAME, DataParallelStack, _model_apps, problems=_problems, llm_deployments=_llm_deployments)
