"""Adding a topology kind is one module plus one registry line (builders/README.md): a toy kind defined here, in the
test tree, registered through the registry's public function, is validated (its own problems included), planned,
described by status and rendered for KubeRay without a product file naming it; the registry refuses a second kind of
the same name and a stack model whose `kind` is not the kind's name."""

from __future__ import annotations

from typing import Any, Literal

import pytest
import yaml
from pydantic import Field

from builders.kinds.kind import ModelApps, TopologyKind
from builders.kinds.openai import replica_model_apps
from builders.kinds.registry import BUILT_IN, KINDS, KindRegistryError
from builders.kuberay import kuberay_manifests, pod_plan, worker_pods
from builders.plan import build_plan, serve_config
from builders.specs import parse_spec, topology_json_schema
from sluice.deploy.status import app_roles
from topologies.problems import SpecError, SpecProblem
from topologies.sections import Scaling
from topologies.spec import ModelBase, StackBase

# ---- the toy kind: what a new kind module holds ----
NAME = "toy_pairs"
# Each replica of a toy model takes two pods on KubeRay, and a toy model may have at most this many replicas.
PODS_PER_REPLICA = 2
MAX_REPLICAS = 3


class ToyModel(ModelBase, Scaling):
    motto: str = "two by two"


class ToyStack(StackBase):
    kind: Literal["toy_pairs"]
    models: list[ToyModel] = Field(min_length=1)


def _model_apps(spec: ToyStack, index: int, model: ToyModel, stem: str) -> ModelApps:
    apps, route, planned = replica_model_apps(spec, index, model, stem)
    return apps, route, planned.model_copy(update={"app_roles": {planned.llm_app: f"toy pairs of {model.name}"}})


def _problems(spec: ToyStack, index: int, model: ToyModel) -> list[SpecProblem]:
    if model.fixed_replicas > MAX_REPLICAS:
        return [SpecProblem(f"models[{index}].replicas", f"a toy model has at most {MAX_REPLICAS} replicas")]
    return []


def _llm_deployments(model: ToyModel) -> list[tuple[Scaling, int]]:
    return [(model, PODS_PER_REPLICA)]


KIND = TopologyKind(NAME, ToyStack, _model_apps, problems=_problems, llm_deployments=_llm_deployments)
# ---- end of the toy module ----


def _spec(**model: Any) -> dict[str, Any]:
    return {
        "kind": NAME,
        "team": "platform",
        "name": "toy",
        "models": [{"name": "sluice-tiny", "source": "tiny", "replicas": 2, **model}],
    }


@pytest.fixture
def toy(request: pytest.FixtureRequest) -> TopologyKind:
    KINDS.register(KIND)  # the one registry line
    request.addfinalizer(lambda: KINDS.unregister(NAME))
    return KIND


def test_a_registered_kind_is_validated_with_its_own_problems_and_in_the_schema(toy: TopologyKind) -> None:
    with pytest.raises(SpecError) as refused:
        parse_spec({**_spec(), "kind": "toy_trios"})
    assert [str(problem) for problem in refused.value.problems] == [
        "kind: unknown kind: use one of openai, data_parallel, prefill_decode, toy_pairs"
    ]
    spec = parse_spec(_spec(motto="side by side"))
    assert isinstance(spec, ToyStack) and spec.models[0].motto == "side by side"
    assert any(one.get("$ref", "").endswith("/ToyStack") for one in topology_json_schema()["oneOf"])
    with pytest.raises(SpecError) as refused:
        parse_spec(_spec(replicas=4, motto=7))
    problems = {problem.path for problem in refused.value.problems}
    assert problems == {"models[0].motto"}, "a field problem is reported before the kind's own checks run"
    with pytest.raises(SpecError) as refused:
        parse_spec(_spec(replicas=4))
    assert [(p.path, p.message) for p in refused.value.problems] == [
        ("models[0].replicas", f"a toy model has at most {MAX_REPLICAS} replicas")
    ]


def test_a_registered_kind_is_planned_described_and_rendered_for_kuberay(toy: TopologyKind) -> None:
    spec = parse_spec(_spec())
    plan = build_plan(spec)
    assert [app.name for app in plan.apps] == ["platform-toy-llm", "platform-toy-router", "platform-toy-frontend"]
    serve_config(plan)  # Ray's own schema accepts it
    assert app_roles(plan)["platform-toy-llm"] == "toy pairs of sluice-tiny"
    assert sum(count.replicas for count in worker_pods(spec).values()) == 2 * PODS_PER_REPLICA
    service, *_ = kuberay_manifests(spec, pod_plan(spec))
    groups = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert sum(group["replicas"] for group in groups) == 2 * PODS_PER_REPLICA
    served = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    assert [app["name"] for app in served] == [app.name for app in plan.apps]


def test_an_unregistered_kind_is_refused_naming_the_kinds_there_are() -> None:
    assert [kind.name for kind in KINDS.items()] == [kind.name for kind in BUILT_IN]
    with pytest.raises(SpecError) as refused:
        parse_spec(_spec())
    assert [str(problem) for problem in refused.value.problems] == [
        "kind: unknown kind: use one of openai, data_parallel, prefill_decode"
    ]
    with pytest.raises(KindRegistryError, match="unknown topology kind 'toy_pairs'"):
        KINDS.unregister(NAME)


def test_a_second_kind_of_the_same_name_and_a_mismatched_stack_model_are_refused(toy: TopologyKind) -> None:
    with pytest.raises(KindRegistryError, match="'toy_pairs' is already registered"):
        KINDS.register(TopologyKind(NAME, ToyStack, _model_apps))
    with pytest.raises(ValueError, match=r"must be Literal\['other'\]"):
        TopologyKind("other", ToyStack, _model_apps)
