"""`sluice check`'s startup path item: each model runs direct streaming (HAProxy pins each request to a replica its
routers chose, the stream flows back through HAProxy alone) with the routers and policy the stack planned, read from
the running frontend's status and from the routers themselves."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sluice.deploy.check.items import Result

if TYPE_CHECKING:
    from builders.plan_types import PlannedModel, StackPlan

NO_FRONTEND_STATUS = "the frontend did not answer its status call (not deployed, or not running)"
RoutersReport = Callable[["PlannedModel"], dict[str, Any] | None]


def _up(frontend: dict[str, Any], backend: str) -> int:
    return sum(1 for s in frontend["servers"] if s["backend"] == backend and s["status"] == "UP")


def _direct_weight(frontend: dict[str, Any], model: PlannedModel) -> int:
    """The model's share of sessions on the direct path, as HAProxy holds it."""
    return frontend["haproxy_weights"].get(model.llm_app, frontend["direct_weight"])


def model_path(frontend: dict[str, Any], model: PlannedModel, routers: dict[str, Any] | None) -> list[str]:
    """What keeps `model` off the planned direct path (nothing: it runs as planned)."""
    problems = []
    if routers is None:
        problems.append(f"{model.name}: no router of {model.router_app} answers")
    else:
        if routers["policy"] != model.policy:
            problems.append(f"{model.name}: the routers run {routers['policy']}, the stack plans {model.policy}")
        if routers.get("prefill_policy") != model.prefill_policy:
            problems.append(
                f"{model.name}: the routers pick prefill replicas by {routers.get('prefill_policy')},"
                f" the stack plans {model.prefill_policy}"
            )
    if not _up(frontend, model.router_backend):
        problems.append(f"{model.name}: no router UP in HAProxy's {model.router_backend}")
    if not _up(frontend, model.replica_backend):
        problems.append(f"{model.name}: no replica UP in HAProxy's {model.replica_backend}")
    if _direct_weight(frontend, model) == 0:
        problems.append(f"{model.name}: every session goes to the legacy path (direct weight 0: rolled back)")
    return problems


def startup_path(frontend: dict[str, Any] | None, plan: StackPlan, routers_report: RoutersReport) -> Result:
    if frontend is None:
        return False, NO_FRONTEND_STATUS
    if not frontend.get("running"):
        return False, "the frontend's HAProxy is not running"
    problems = [p for model in plan.models for p in model_path(frontend, model, routers_report(model))]
    if problems:
        return False, "; ".join(problems)
    return True, "; ".join(
        f"{m.name}: direct streaming, {_up(frontend, m.router_backend)} routers UP running {m.policy}"
        + (f" (prefill {m.prefill_policy})" if m.prefill_policy else "")
        + f", {_up(frontend, m.replica_backend)} replicas UP, direct weight {_direct_weight(frontend, m)}"
        for m in plan.models
    )
