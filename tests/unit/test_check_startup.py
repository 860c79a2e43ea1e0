"""`sluice check`'s startup path item, read from a frontend's status and the routers' own report."""

from __future__ import annotations

from typing import Any

from builders.plan_types import PlannedModel
from sluice.deploy.check.startup import startup_path

MODEL = PlannedModel(
    name="tiny",
    llm_app="s-tiny-llm",
    router_app="s-tiny-router",
    replica_backend="sluice_replicas",
    router_backend="sluice_routers",
    policy="round_robin",
    min_replicas=2,
    routers=1,
)


class Plan:
    models = [MODEL]


def _frontend(weight: int = 30, replicas_up: int = 2, routers_up: int = 1) -> dict[str, Any]:
    servers = [{"backend": "sluice_replicas", "server": f"r{i}", "status": "UP"} for i in range(replicas_up)]
    servers += [{"backend": "sluice_routers", "server": f"q{i}", "status": "UP"} for i in range(routers_up)]
    servers.append({"backend": "sluice_replicas", "server": "down", "status": "DOWN"})
    return {"running": True, "servers": servers, "direct_weight": weight, "haproxy_weights": {MODEL.llm_app: weight}}


def _routers(policy: str = "round_robin", prefill: str | None = None) -> Any:
    return lambda model: {"policy": policy, "policy_kwargs": {}, "prefill_policy": prefill}


def test_a_model_on_its_planned_direct_path_passes_with_what_runs() -> None:
    ok, detail = startup_path(_frontend(), Plan(), _routers())  # type: ignore[arg-type]
    assert ok is True
    assert detail == "tiny: direct streaming, 1 routers UP running round_robin, 2 replicas UP, direct weight 30"


def test_each_way_off_the_planned_path_is_named() -> None:
    cases = [
        (_frontend(), _routers("consistent_hash"), "the routers run consistent_hash, the stack plans round_robin"),
        (_frontend(), _routers(prefill="round_robin"), "pick prefill replicas by round_robin"),
        (_frontend(), lambda model: None, "no router of s-tiny-router answers"),
        (_frontend(routers_up=0), _routers(), "no router UP in HAProxy's sluice_routers"),
        (_frontend(replicas_up=0), _routers(), "no replica UP in HAProxy's sluice_replicas"),
        (_frontend(weight=0), _routers(), "direct weight 0: rolled back"),
        ({"running": False}, _routers(), "the frontend's HAProxy is not running"),
    ]
    for frontend, routers, named in cases:
        ok, detail = startup_path(frontend, Plan(), routers)  # type: ignore[arg-type]
        assert ok is False and named in detail, (named, detail)


def test_a_frontend_that_does_not_answer_fails_the_startup_path_and_the_server_map_by_name() -> None:
    from sluice.deploy.check.checklist import server_map
    from sluice.deploy.check.startup import NO_FRONTEND_STATUS

    assert startup_path(None, Plan(), _routers()) == (False, NO_FRONTEND_STATUS)  # type: ignore[arg-type]
    assert server_map(None, Plan()) == (False, NO_FRONTEND_STATUS)  # type: ignore[arg-type]
