"""Table decisions, router side and spec side: which policies publish a table, what it holds for the asking frontend,
when it is refused, and what `sluice validate` says of a stack that asks for tables it cannot have."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from base.contracts import (
    FAULT_PATH,
    FRONTEND_HEADER,
    REASON_INJECTED_FAULT,
    REASON_NO_REPLICA,
    REASON_NO_TABLE,
    ROUTE_TABLE_PATH,
    TABLE_RING,
    TABLE_ROTATION,
)
from base.route_wire import RouteRefusal, RouteTable
from builders.plan import build_plan
from builders.specs import parse_spec
from infra.haproxy.config import HAProxySettings
from infra.haproxy.haproxy_cfg import render_config
from infra.haproxy.lua import render_lua
from infra.haproxy.tables import TABLE_DECISION_TABLE, VAR_TABLE_KIND
from routers.core import ReplicaView
from services.router.http_app import build_router_app
from services.router.settings import PrefillTarget, RouterSettings, build_policy
from tests.support.router_service_client import REPLICA_IDS, publish, router, unique_app, views
from topologies.spec import SpecError, read_spec_data


async def _table(client: httpx.AsyncClient, frontend: str | None = None) -> httpx.Response:
    return await client.get(ROUTE_TABLE_PATH, headers={FRONTEND_HEADER: frontend} if frontend else {})


@pytest.mark.parametrize(
    ("policy", "kwargs", "kind", "fallbacks"),
    [
        ("round_robin", {}, TABLE_ROTATION, 2),
        ("consistent_hash", {}, TABLE_RING, 2),
        ("consistent_hash", {"num_fallback_replicas": 1}, TABLE_RING, 1),
    ],
)
def test_a_rotation_or_plain_ring_publishes_the_sorted_ids_it_ranks(
    policy: str, kwargs: dict, kind: str, fallbacks: int
) -> None:
    settings = RouterSettings(target_app=unique_app(), policy=policy, policy_kwargs=kwargs)

    async def run() -> None:
        async with router(settings, views(list(reversed(REPLICA_IDS)))) as client:
            reply = await _table(client)
        assert reply.status_code == 200
        assert RouteTable.model_validate_json(reply.content) == RouteTable(
            kind=kind, fallbacks=fallbacks, replica_ids=sorted(REPLICA_IDS)
        )

    asyncio.run(run())


def test_the_table_holds_only_what_the_asking_frontend_published_and_what_is_routable() -> None:
    settings = RouterSettings(target_app=unique_app())
    draining = [*views(REPLICA_IDS[:3]), ReplicaView(replica_id=REPLICA_IDS[3], draining=True)]

    async def run() -> None:
        async with router(settings, draining) as client:
            await publish(client, "frontend-a", REPLICA_IDS[:2])
            await publish(client, "frontend-b", REPLICA_IDS)
            a, b = await _table(client, "frontend-a"), await _table(client, "frontend-b")
        assert a.json()["replica_ids"] == sorted(REPLICA_IDS[:2])
        assert b.json()["replica_ids"] == sorted(REPLICA_IDS[:3])  # the draining one is not ranked

    asyncio.run(run())


@pytest.mark.parametrize(
    ("policy", "kwargs"),
    [
        ("power_of_two", {}),
        ("consistent_hash", {"load_factor": 1.25}),
        ("consistent_hash", {"user_affinity": True}),
    ],
)
def test_a_policy_that_reads_live_state_or_the_body_has_no_table(policy: str, kwargs: dict) -> None:
    settings = RouterSettings(target_app=unique_app(), policy=policy, policy_kwargs=kwargs)

    async def run() -> None:
        async with router(settings, views()) as client:
            reply = await _table(client)
        assert (reply.status_code, RouteRefusal.model_validate_json(reply.content).reason) == (404, REASON_NO_TABLE)

    asyncio.run(run())


def test_a_prefill_decode_router_has_no_table() -> None:
    settings = RouterSettings(target_app=unique_app(), prefill=PrefillTarget(app="prefill"))
    policy = build_policy(settings)
    app = build_router_app(settings, policy, lambda: views(), prefill=object())  # type: ignore[arg-type]

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            reply = await _table(client)
        assert (reply.status_code, reply.json()["reason"]) == (404, REASON_NO_TABLE)

    asyncio.run(run())


def test_a_faulty_router_or_an_empty_set_refuses_its_table_as_it_would_every_route_call() -> None:
    faulty = RouterSettings(target_app=unique_app(), fault_injection=True)

    async def run() -> None:
        async with router(faulty, views()) as client:
            assert (await client.post(FAULT_PATH, json={"seconds": 30})).status_code == 204
            refused = await _table(client)
            assert (await client.post(FAULT_PATH, json={"seconds": 0})).status_code == 204
            back = await _table(client)
        async with router(RouterSettings(target_app=unique_app()), []) as client:
            empty = await _table(client)
        assert (refused.status_code, refused.json()["reason"]) == (500, REASON_INJECTED_FAULT)
        assert back.status_code == 200
        assert (empty.status_code, empty.json()["reason"]) == (503, REASON_NO_REPLICA)

    asyncio.run(run())


def _stack(policy: str, kwargs: dict | None = None, file: str = "local-cpu.yaml") -> dict:
    data = read_spec_data(f"topologies/teams/{file}")
    data["routing"] = {**data.get("routing", {}), "policy": policy, "policy_kwargs": kwargs or {}}
    data["routing"]["table_decisions"] = True
    return data


@pytest.mark.parametrize(
    ("policy", "kwargs"), [("power_of_two", {}), ("kv_aware", {}), ("consistent_hash", {"load_factor": 1.5})]
)
def test_validate_refuses_table_decisions_with_a_policy_that_has_no_table(policy: str, kwargs: dict) -> None:
    data = _stack(policy, kwargs)
    if policy == "kv_aware":
        data["routing"]["forward_body"] = True
    with pytest.raises(SpecError) as raised:
        parse_spec(data)
    assert "routing.table_decisions" in str(raised.value)
    assert "round_robin or consistent_hash" in str(raised.value)


def test_validate_refuses_table_decisions_on_a_prefill_decode_stack() -> None:
    data = read_spec_data("topologies/teams/prefill-decode-cpu.yaml")
    data["routing"]["table_decisions"] = True
    with pytest.raises(SpecError) as raised:
        parse_spec(data)
    assert "routing.table_decisions" in str(raised.value) and "prefill/decode" in str(raised.value)


def _frontend_settings(data: dict) -> tuple[HAProxySettings, str]:
    plan = build_plan(parse_spec(data))
    (frontend,) = [app for app in plan.apps if app.name.endswith("-frontend")]
    return HAProxySettings(workdir=Path("/tmp/x"), **frontend.args["haproxy"]), plan.models[0].router_app


def test_a_stack_with_table_decisions_renders_a_frontend_that_fetches_tables_and_counts_its_decisions() -> None:
    settings, router_app = _frontend_settings(_stack("consistent_hash"))
    assert [app.table_decisions for app in settings.apps] == [True]
    config, lua = render_config(settings), render_lua(settings)
    assert f"track-sc2 var({VAR_TABLE_KIND}) table {TABLE_DECISION_TABLE}" in config
    assert f"backend {TABLE_DECISION_TABLE}" in config
    assert "tables = true" in lua and f'table_path = "/{router_app}{ROUTE_TABLE_PATH}"' in lua
    off, _ = _frontend_settings(read_spec_data("topologies/teams/local-cpu.yaml"))
    assert "tables = false" in render_lua(off)
