"""What a topology kind module hands the kind registry (`TopologyKind`): its spec section, its apps in the plan, its
KubeRay parts and how `sluice status` describes its apps.

Every kind module defines `NAME` (the spec's `kind`), its stack model (a `StackBase` with `kind: Literal[NAME]` and
its `models`) and `KIND = TopologyKind(...)`; `builders.kinds.registry` lists them. Spec validation, the plan, the
KubeRay render and status ask the registry; nothing outside `builders/kinds/` tests a kind's type.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from builders.plan_types import PlannedModel, ServeApp
from infra.haproxy.apps import AppRoute
from topologies.problems import SpecProblem
from topologies.sections import Scaling
from topologies.spec import StackBase

# A model's Serve apps, the frontend's route to it, and what the plan says of it (its `app_roles` included).
ModelApps = tuple[list[ServeApp], AppRoute, PlannedModel]


def _no_problems(spec: Any, index: int, model: Any) -> list[SpecProblem]:
    return []


def _no_roles(model: Any) -> list[tuple[str, Any]]:
    return []


def _one_deployment(model: Any) -> list[tuple[Scaling, int]]:
    return [(model, 1)]


@dataclass(frozen=True)
class TopologyKind:
    """One kind of stack as the rest of sluice sees it."""

    name: str
    # The spec of a stack of this kind: a `StackBase` whose `kind` is `Literal[name]` and whose `models` are its own.
    stack: type[StackBase]
    # One model's apps (spec, the model's index, the model, the stem of its app names).
    model_apps: Callable[[Any, int, Any, str], ModelApps]
    # Problems of one model that no field alone shows (spec, index, model): each with its path and the fix.
    problems: Callable[[Any, int, Any], list[SpecProblem]] = _no_problems
    # (role, section) of each part of a model with routing and engine overrides of its own (prefill/decode's sides):
    # spec validation checks their policies and vLLM their engine arguments.
    roles: Callable[[Any], Iterable[tuple[str, Any]]] = _no_roles
    # (scaling, pods per replica) of each LLM deployment of a model: KubeRay's worker groups.
    llm_deployments: Callable[[Any], Iterable[tuple[Scaling, int]]] = _one_deployment

    def __post_init__(self) -> None:
        literal = self.stack.model_fields["kind"].annotation
        if getattr(literal, "__args__", None) != (self.name,):
            raise ValueError(f"kind {self.name!r}: its stack model's `kind` must be Literal[{self.name!r}]")
