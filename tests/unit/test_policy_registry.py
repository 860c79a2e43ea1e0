"""Adding a policy is one module plus one registry line: a toy policy, registered through the registry's public
function, passes spec validation, reaches the router service's policy construction, the builders and the Serve
adapters; the registry refuses a second policy of the same name, and an unknown name fails as it always did."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import Field, ValidationError

from base.route_wire import RouteReply
from builders.plan import build_plan
from builders.specs import parse_spec, topology_json_schema
from infra.observability.targets import METRICS_PATH
from routers.core import ReplicaView, RouteRequest, RoutingPolicy
from routers.entry import PolicyContext, PolicyEntry, PolicyReport, PolicySettings
from routers.registry import (
    BUILT_IN,
    PolicyConfigError,
    policy_entry,
    policy_names,
    register_policy,
    unregister_policy,
    validate_settings,
)
from routers.round_robin import NAME as ROUND_ROBIN
from routers.serve_adapters import request_router_config
from services.replica.llm_config import LLMAppConfig
from services.router.settings import PrefillTarget, RouterAppArgs, RouterSettings
from sluice.deploy.status import model_line
from tests.support.router_service_client import REPLICA_IDS, route, router, sample, unique_app, views
from topologies.problems import SpecError

# ---- the toy policy: what a new policy module holds ----
NAME = "toy_last"


class ToyLastSettings(PolicySettings):
    # Which replica from the end of the sorted ids is the primary.
    offset: int = Field(0, ge=0)


class ToyLast(RoutingPolicy):
    """The replica `offset` from the end of the sorted ids, alone: easy to tell from every built-in policy."""

    name = NAME

    def __init__(self, offset: int) -> None:
        super().__init__()
        self.offset = offset

    def _rank(self, replicas: list[ReplicaView], request: RouteRequest) -> tuple[list[list[ReplicaView]], str]:
        ordered = sorted(replicas, key=lambda view: view.replica_id)
        return [[ordered[-1 - self.offset % len(ordered)]]], "last"


def _build(settings: ToyLastSettings, context: PolicyContext) -> ToyLast:
    return ToyLast(settings.offset)


ENTRY = PolicyEntry(NAME, ToyLastSettings, _build)
# ---- end of the toy module ----

SPEC: dict[str, Any] = {
    "kind": "openai",
    "team": "platform",
    "name": "toy",
    "routing": {"policy": NAME, "policy_kwargs": {"offset": 1}},
    "models": [{"name": "sluice-tiny", "source": "tiny", "replicas": 2}],
}


@pytest.fixture
def toy() -> Iterator[PolicyEntry]:
    register_policy(ENTRY)  # the one registry line
    try:
        yield ENTRY
    finally:
        unregister_policy(NAME)


def test_a_registered_policy_passes_spec_validation_and_reaches_the_router_apps_args(toy: PolicyEntry) -> None:
    spec = parse_spec(json.loads(json.dumps(SPEC)))
    assert (spec.routing.policy, spec.routing.policy_kwargs) == (NAME, {"offset": 1})
    assert NAME in topology_json_schema()["$defs"]["Routing"]["properties"]["policy"]["enum"]
    llm, router_app, _ = build_plan(spec).apps[:3]
    settings = RouterAppArgs.model_validate(router_app.args).settings
    assert (settings.policy, settings.policy_kwargs) == (NAME, {"offset": 1})
    deployment = LLMAppConfig.model_validate(llm.args).deployment
    assert deployment.handle_policy == NAME and not deployment.capacity_ledger
    # Its kwargs are checked like any policy's.
    bad = json.loads(json.dumps(SPEC))
    bad["routing"]["policy_kwargs"] = {"offset": -1}
    with pytest.raises(SpecError) as refused:
        parse_spec(bad)
    assert "routing.policy_kwargs" in {problem.path for problem in refused.value.problems}


def test_a_registered_policy_is_built_and_used_by_the_router_service(toy: PolicyEntry) -> None:
    app = unique_app()

    async def scenario() -> RouteReply:
        async with router(RouterSettings(target_app=app, policy=NAME, policy_kwargs={"offset": 1}), views()) as client:
            reply = await route(client, "any-session")
        assert reply.status_code == 200, reply.text
        return RouteReply.model_validate(reply.json())

    reply = asyncio.run(scenario())
    assert (reply.replica_id, reply.fallbacks) == (sorted(REPLICA_IDS)[-2], [])
    assert sample("sluice_router_routed_total", app=app, policy=NAME) == 1
    # A stateless toy may choose the prefill replica too.
    assert PrefillTarget(app="p", policy=NAME).policy == NAME


def test_the_router_service_asks_a_policys_entry_for_its_report_and_gauges() -> None:
    """What the service does for a policy comes from its entry (routers/README.md, the hooks): the toy's report is
    served at the path its entry names and printed by status as it says, and its refresh runs before /metrics is
    read."""
    refreshed: list[tuple[str, str]] = []

    async def refresh(policy: ToyLast, app: str) -> None:
        refreshed.append((policy.name, app))

    report = PolicyReport(
        "toy",
        "/internal/toy-report",
        lambda policy: {"offset": policy.offset},
        lambda body: [f"toy at {body['offset']}"],
    )
    register_policy(dataclasses.replace(ENTRY, report=report, refresh_metrics=refresh))
    app = unique_app()

    async def scenario() -> tuple[int, dict, int]:
        async with router(RouterSettings(target_app=app, policy=NAME, policy_kwargs={"offset": 1}), views()) as client:
            served = await client.get(report.path)
            return served.status_code, served.json(), (await client.get(METRICS_PATH)).status_code

    try:
        status, body, metrics = asyncio.run(scenario())
    finally:
        unregister_policy(NAME)
    assert (status, body, metrics) == (200, {"offset": 1}, 200)
    assert refreshed == [(NAME, app)]
    # `sluice status` prints the report a running router describes, as the entry says.
    register_policy(dataclasses.replace(ENTRY, report=report))
    try:
        planned = build_plan(parse_spec(json.loads(json.dumps(SPEC)))).models[0]
        described = {"policy": NAME, "policy_kwargs": {"offset": 1}, "prefill_policy": None, "toy": body}
        assert model_line(planned, described).endswith("\n    toy at 1")
    finally:
        unregister_policy(NAME)


def test_a_registered_policy_gets_a_serve_adapter_importable_by_its_path(toy: PolicyEntry) -> None:
    config = request_router_config(NAME, offset=2)
    assert config.request_router_class == toy.adapter == "routers.serve_adapters.ToyLastRequestRouter"
    module, _, name = toy.adapter.rpartition(".")
    adapter = getattr(importlib.import_module(module), name)
    assert adapter.policy_name == NAME


def test_unregistering_forgets_the_policy() -> None:
    register_policy(ENTRY)
    unregister_policy(NAME)
    assert NAME not in policy_names()
    with pytest.raises(SpecError):
        parse_spec(json.loads(json.dumps(SPEC)))


def test_a_second_policy_of_the_same_name_is_refused(toy: PolicyEntry) -> None:
    with pytest.raises(PolicyConfigError, match="routing policy 'toy_last' is already registered"):
        register_policy(PolicyEntry(NAME, ToyLastSettings, _build))
    with pytest.raises(PolicyConfigError, match=f"'{ROUND_ROBIN}' is already registered"):
        register_policy(policy_entry(ROUND_ROBIN))
    assert policy_entry(NAME) is ENTRY


def test_a_policy_name_must_be_a_lower_case_identifier() -> None:
    with pytest.raises(ValueError, match="lower-case words"):
        PolicyEntry("Toy-Last", ToyLastSettings, _build)


def test_an_unknown_name_fails_as_before_the_registry() -> None:
    known = [entry.name for entry in BUILT_IN]
    assert policy_names() == known
    with pytest.raises(PolicyConfigError, match=r"unknown routing policy 'toy_last'; choose one of \[.*\]"):
        validate_settings(NAME, {})
    with pytest.raises(ValidationError, match="unknown routing policy 'toy_last'"):
        RouterSettings(target_app="llm", policy=NAME)
    with pytest.raises(SpecError) as refused:
        parse_spec(json.loads(json.dumps(SPEC)))
    expected = "Input should be " + ", ".join(repr(n) for n in known[:-1]) + f" or {known[-1]!r}"
    assert {problem.path: problem.message for problem in refused.value.problems} == {"routing.policy": expected}
    with pytest.raises(PolicyConfigError):
        unregister_policy(NAME)
