"""Table decisions end to end: real HAProxy ranking from the real router service's table, real vLLM replicas. Every
request is served by the replica the router's own route call names for its session, with no route call made, and
a router put in maintenance fails requests closed at once (the table goes with it)."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Iterator

import httpx
import pytest

from base.contracts import REASON_ROUTER_UNREACHABLE, REPLICA_HEADER, ROUTE_PATH, SERVE_REASON_HEADER, TABLE_RING
from base.waiting import wait_until
from infra.haproxy.config import router_backend
from services.internal_credential import internal_headers
from services.serve_internals import list_replica_endpoints
from sluice.bench.stack_harness import DirectStreamStack
from tests.support.frontend_metrics import table_decisions
from tests.support.llm_cluster import LLMCluster, direct_stack

pytestmark = pytest.mark.integration

COMPLETION = {"model": "sluice-tiny", "prompt": "ka lo", "max_tokens": 2}
REQUESTS = 60


@pytest.fixture(scope="module")
def stack(llm_cluster: LLMCluster) -> Iterator[DirectStreamStack]:
    with direct_stack(llm_cluster, routers=2, policy="consistent_hash", table_decisions=True) as started:
        yield started


def _ring_decisions(stack: DirectStreamStack) -> int:
    return table_decisions(stack.spec.prometheus_port)[TABLE_RING]


def _routed_by_routers(stack: DirectStreamStack) -> float:
    """Route calls the routers answered (each router replica's own counter, summed)."""
    total = 0.0
    for router in asyncio.run(list_replica_endpoints(stack.spec.router_app)):
        text = httpx.get(f"{router.url}{stack.spec.router_route_prefix}/metrics", timeout=5).text
        total += sum(float(m[1]) for m in re.finditer(r"^sluice_router_routed_total\{.*\} ([0-9.e+]+)$", text, re.M))
    return total


def _complete(client: httpx.Client, stack: DirectStreamStack, session: str) -> httpx.Response:
    return client.post(f"{stack.url}/v1/completions", json=COMPLETION, headers={"x-session-id": session})


def test_each_request_goes_where_the_router_would_send_it_without_a_route_call(stack: DirectStreamStack) -> None:
    with httpx.Client(timeout=60) as client:

        def table_in_force() -> bool:
            before = _ring_decisions(stack)
            _complete(client, stack, uuid.uuid4().hex)
            return _ring_decisions(stack) > before

        wait_until(30, table_in_force, "the frontend to rank from the routers' table")
        routed, decided = _routed_by_routers(stack), _ring_decisions(stack)
        sessions = [uuid.uuid4().hex for _ in range(REQUESTS)]
        served = {}
        for session in sessions:
            response = _complete(client, stack, session)
            assert response.status_code == 200, response.text
            served[session] = response.headers[REPLICA_HEADER]
        assert _ring_decisions(stack) - decided == REQUESTS
        assert _routed_by_routers(stack) == routed  # no route call reached a router
        router = asyncio.run(list_replica_endpoints(stack.spec.router_app))[0]
        route_url = f"{router.url}{stack.spec.router_route_prefix}{ROUTE_PATH}"
        internal = internal_headers()
        chosen = {
            s: client.post(route_url, headers={**internal, "x-session-id": s}).json()["replica_id"] for s in sessions
        }
    assert served == chosen
    assert len(set(served.values())) > 1


def test_routers_in_maintenance_fail_requests_closed_at_once(stack: DirectStreamStack) -> None:
    runtime = stack.runtime
    assert runtime is not None
    backend = router_backend(0)
    routers = [name for (pool, name) in runtime.show_stat() if pool == backend]
    assert len(routers) == 2
    for name in routers:
        runtime.set_server_state(backend, name, "maint")
    try:
        with httpx.Client(timeout=60) as client:
            responses = [_complete(client, stack, uuid.uuid4().hex) for _ in range(4)]
        assert [(r.status_code, r.headers.get(SERVE_REASON_HEADER)) for r in responses] == [
            (503, REASON_ROUTER_UNREACHABLE)
        ] * 4
    finally:
        for name in routers:
            runtime.set_server_state(backend, name, "ready")
