"""Table decisions through a real HAProxy and the real router app (round_robin and consistent_hash) in front of
stand-in replicas: the frontend ranks each request from the router's table with no route call, exactly as the
router's policy would; a router fault and a router put in maintenance take the table away, and requests go back to
the route call and fail closed as before."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from base.contracts import (
    FAULT_PATH,
    HEALTH_PATH,
    RANKED_HEADER,
    REASON_INJECTED_FAULT,
    REASON_ROUTER_UNREACHABLE,
    REPLICA_HEADER,
    ROUTE_PATH,
    SESSION_HEADER_DEFAULT,
    TABLE_LEASE_S,
    TABLE_RING,
    TABLE_ROTATION,
)
from base.waiting import wait_until
from infra.haproxy.apps import AppRoute
from infra.haproxy.config import ROUTER_BACKEND
from routers.consistent_hash import ConsistentHash
from routers.core import ReplicaView
from services.router.http_app import build_router_app
from services.router.settings import RouterSettings, build_policy
from tests.integration.standin_plane.plane import Plane, start_plane, stop_plane
from tests.integration.standin_plane.standins import (
    APP,
    CHAT_PATH,
    LoopThread,
    ReplicaStandIn,
    StandIn,
    assert_fail_closed,
    first_event,
    respond,
)
from tests.support.frontend_metrics import table_decisions

pytestmark = pytest.mark.integration

REPLICAS = ("t1", "t2", "t3")
KIND_OF = {"round_robin": TABLE_ROTATION, "consistent_hash": TABLE_RING}
# Enough decisions to see every replica and fallback order many times over.
DECISIONS = 45
# How long the frontend may take to fetch a table again (several refresh intervals, within a lease).
TABLE_WAIT_S = 10.0


class RouterApp(StandIn):
    """The real router app (`build_router_app`) over static views of the stand-in replicas; counts route calls."""

    def __init__(self, name: str, policy: str, views: tuple[ReplicaView, ...]) -> None:
        super().__init__(name)
        settings = RouterSettings(target_app=APP, policy=policy, fault_injection=True)
        self.app = build_router_app(settings, build_policy(settings), lambda: views)
        self.route_calls = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == HEALTH_PATH:
            await respond(send, 200, b"ok")
            return
        if scope["type"] == "http" and scope["path"] == ROUTE_PATH:
            self.route_calls += 1
        await self.app(scope, receive, send)


@dataclass
class TableEnv:
    policy: str
    loop: LoopThread
    router: RouterApp
    plane: Plane


@pytest.fixture(scope="module", params=list(KIND_OF))
def tables(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TableEnv]:
    loop = LoopThread()
    replicas = [ReplicaStandIn(name) for name in REPLICAS]
    views = tuple(ReplicaView(replica_id=r.name, endpoint=r.url) for r in replicas)
    router = RouterApp("table-router", request.param, views)
    started: list[StandIn] = []
    plane = None
    try:
        for stand_in in (*replicas, router):
            loop.run(stand_in.start())
            started.append(stand_in)
        app = AppRoute(name=APP, table_decisions=True)
        workdir = Path(tmp_path_factory.mktemp(f"tables-{request.param}"))
        plane = start_plane(loop, workdir, app, [r.endpoint for r in replicas], [router.endpoint])
        yield TableEnv(request.param, loop, router, plane)
    finally:
        if plane is not None:
            stop_plane(plane)
        for stand_in in started:
            loop.run(stand_in.stop())
        loop.close()


def _table_decisions(plane: Plane) -> dict[str, int]:
    return table_decisions(plane.haproxy.settings.prometheus_port)


def _post(client: httpx.Client, session: str) -> httpx.Response:
    body = {"model": "stand-in", "messages": [{"role": "user", "content": "hi"}]}
    return client.post(CHAT_PATH, json=body, headers={SESSION_HEADER_DEFAULT: session})


def _decided_from_table(env: TableEnv) -> bool:
    """Whether a request on a new connection (any HAProxy thread) was ranked from a table."""
    before = sum(_table_decisions(env.plane).values())
    with httpx.Client(base_url=env.plane.url, timeout=10) as client:
        _post(client, "probe")
    return sum(_table_decisions(env.plane).values()) > before


def _ranked(response: httpx.Response) -> list[str]:
    """The replicas the frontend ranked for this request: the one that served it, then the rest it passed along."""
    event = first_event(response)
    ranked = dict(event["headers"])[RANKED_HEADER]
    rest = ranked.split("|", 1)[1]
    return [event["replica"], *(entry.split("=", 1)[1] for entry in rest.split(",") if entry)]


def _expected(env: TableEnv, sessions: list[str], ranked: list[list[str]]) -> list[list[str]]:
    """What the router's own policy ranks for these requests (a rotation starts where the frontend's cursor was)."""
    ordered = sorted(REPLICAS)
    if env.policy == "round_robin":
        start = ordered.index(ranked[0][0])
        return [[ordered[(start + i + k) % len(ordered)] for k in range(len(ordered))] for i in range(len(sessions))]
    ring = ConsistentHash()
    ring.on_replicas_changed(ordered)
    return [ring.lookup(session)[0] for session in sessions]


def test_every_request_is_ranked_from_the_table_as_the_policy_would_with_no_route_call(tables: TableEnv) -> None:
    wait_until(TABLE_WAIT_S, lambda: _decided_from_table(tables), "a request ranked from the router's table")
    calls, decided = tables.router.route_calls, _table_decisions(tables.plane)
    sessions = [f"session-{i}-" + "k" * i for i in range(DECISIONS)]  # 10 to 55 bytes: every hash branch
    with httpx.Client(base_url=tables.plane.url, timeout=10) as client:  # one connection: one thread's cursor
        responses = [_post(client, session) for session in sessions]
    assert [r.status_code for r in responses] == [200] * DECISIONS
    ranked = [_ranked(r) for r in responses]
    assert ranked == _expected(tables, sessions, ranked)
    assert {r.headers[REPLICA_HEADER] for r in responses} == set(REPLICAS)
    assert tables.router.route_calls == calls  # not one route call
    after = _table_decisions(tables.plane)
    kind = KIND_OF[tables.policy]
    assert after[kind] - decided[kind] == DECISIONS, (decided, after)


def test_an_injected_fault_takes_the_table_away_and_route_calls_fail_closed(tables: TableEnv) -> None:
    wait_until(TABLE_WAIT_S, lambda: _decided_from_table(tables), "a request ranked from the router's table")
    fault = f"{tables.router.url}{FAULT_PATH}"
    assert httpx.post(fault, json={"seconds": 60}).status_code == 204
    try:
        wait_until(TABLE_WAIT_S, lambda: not _decided_from_table(tables), "the frontend to drop the faulty table")
        calls = tables.router.route_calls
        for i in range(6):
            with httpx.Client(base_url=tables.plane.url, timeout=10) as client:  # new connections: every thread
                assert_fail_closed(_post(client, f"faulty-{i}"), REASON_INJECTED_FAULT)
        assert tables.router.route_calls - calls == 6
    finally:
        httpx.post(fault, json={"seconds": 0})
    wait_until(TABLE_WAIT_S, lambda: _decided_from_table(tables), "the table back once the fault ended")


def test_a_router_put_in_maintenance_takes_its_table_with_it_at_once(tables: TableEnv) -> None:
    wait_until(TABLE_WAIT_S, lambda: _decided_from_table(tables), "a request ranked from the router's table")
    runtime = tables.plane.runtime
    runtime.set_server_state(ROUTER_BACKEND, tables.router.name, "maint")
    try:
        for i in range(6):
            with httpx.Client(base_url=tables.plane.url, timeout=10) as client:
                assert_fail_closed(_post(client, f"maint-{i}"), REASON_ROUTER_UNREACHABLE)
    finally:
        runtime.set_server_state(ROUTER_BACKEND, tables.router.name, "ready")
    wait_until(TABLE_WAIT_S, lambda: _decided_from_table(tables), "the table back once the router is ready")


def test_a_table_is_held_no_longer_than_its_lease_without_renewal(tables: TableEnv) -> None:
    """A router that stops answering (its port closed) stops renewing: no request is ranked from its table after
    the lease."""
    wait_until(TABLE_WAIT_S, lambda: _decided_from_table(tables), "a request ranked from the router's table")
    tables.loop.run(tables.router.stop())
    try:
        wait_until(TABLE_LEASE_S + TABLE_WAIT_S, lambda: not _decided_from_table(tables), "the table to lapse")
        with httpx.Client(base_url=tables.plane.url, timeout=10) as client:
            assert_fail_closed(_post(client, "gone"), REASON_ROUTER_UNREACHABLE)
    finally:
        tables.loop.run(tables.router.start())
    wait_until(TABLE_WAIT_S, lambda: _decided_from_table(tables), "the table back once the router answers")
