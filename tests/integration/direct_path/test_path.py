"""The direct-streaming path end to end: real HAProxy -> real router service -> real vLLM replicas."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import uuid

import httpx
import psutil
import pytest

from base.contracts import (
    REASON_ROUTER_UNREACHABLE,
    REPLICA_HEADER,
    REQUEST_ID_HEADER,
    ROUTE_PATH,
    SERVE_REASON_HEADER,
)
from base.waiting import wait_until
from infra.haproxy.config import router_backend
from infra.haproxy.spoe import agent_backend
from services.internal_credential import internal_headers
from services.serve_internals import list_replica_endpoints, wait_for_endpoints
from sluice.bench.stack_harness import DirectStreamStack
from tests.support.llm_cluster import LLMCluster, direct_stack
from tests.support.sse import chunks, data_lines, stream_lines
from tests.support.vllm_metrics import engine_requests

pytestmark = pytest.mark.integration

ROUTE_TIMEOUT_S = 2.0
COMPLETION = {"model": "sluice-tiny", "prompt": "ka lo", "max_tokens": 2}


@pytest.fixture(scope="module")
def stack(llm_cluster: LLMCluster):
    with direct_stack(
        llm_cluster,
        routers=2,
        policy="consistent_hash",
        route_timeout_s=ROUTE_TIMEOUT_S,
        check_inter_s=1.0,
    ) as started:
        yield started


@pytest.fixture(scope="module")
def client():
    # The frontend strips the internal credential; a router's own port asks for it.
    with httpx.Client(timeout=60, headers=internal_headers()) as c:
        yield c


@pytest.fixture(scope="module")
def route_url(stack: DirectStreamStack) -> str:
    """One router replica's route endpoint, asked directly for its decision."""
    router = asyncio.run(list_replica_endpoints(stack.spec.router_app))[0]
    return f"{router.url}{stack.spec.router_route_prefix}{ROUTE_PATH}"


def _router_choice(client: httpx.Client, route_url: str, session: str) -> str:
    reply = client.post(route_url, headers={"x-session-id": session})
    assert reply.status_code == 200, reply.text
    return reply.json()["replica_id"]


def test_every_post_is_served_by_the_replica_the_router_chose(stack, client, route_url) -> None:
    mismatches = []
    for _ in range(200):
        session = uuid.uuid4().hex
        response = client.post(f"{stack.url}/v1/completions", json=COMPLETION, headers={"x-session-id": session})
        assert response.status_code == 200, response.text
        assert response.headers.get(REQUEST_ID_HEADER)
        if response.headers[REPLICA_HEADER] != _router_choice(client, route_url, session):
            mismatches.append(session)
    assert mismatches == []


def test_haproxy_asks_each_routers_agent_over_a_kept_connection_and_checks_its_serve_port(stack, client) -> None:
    routers = asyncio.run(list_replica_endpoints(stack.spec.router_app))
    for _ in range(10):
        response = client.post(f"{stack.url}/v1/completions", json=COMPLETION, headers={"x-session-id": "agent"})
        assert response.status_code == 200, response.text
    stats = stack.runtime.show_stat()
    kept = 0
    for router in routers:
        agent = stats[(agent_backend(0), router.replica_id)]
        assert agent.status.startswith("UP") and int(agent.addr.rsplit(":", 1)[1]) != router.port, agent
        kept += agent.scur
        # The HTTP route call stays on Serve's port (Ray's contract, tools, the fallback).
        assert stats[(router_backend(0), router.replica_id)].addr == f"{router.host}:{router.port}"
        reply = client.post(f"{router.url}{stack.spec.router_route_prefix}{ROUTE_PATH}")
        assert reply.status_code == 200 and reply.json()["replica_id"], reply.text
    # SPOE keeps its connections to the agents open between route calls.
    assert kept >= 1


def test_a_session_sticks_and_unsessioned_requests_spread(stack, client, llm_cluster: LLMCluster) -> None:
    served = {
        client.post(f"{stack.url}/v1/completions", json=COMPLETION, headers={"x-session-id": "team-a"}).headers[
            REPLICA_HEADER
        ]
        for _ in range(20)
    }
    assert len(served) == 1
    spread = {client.post(f"{stack.url}/v1/completions", json=COMPLETION).headers[REPLICA_HEADER] for _ in range(30)}
    assert spread == {e.replica_id for e in llm_cluster.endpoints}


def test_sse_streams_through_haproxy(stack, client) -> None:
    body = {"model": "sluice-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    body |= {"ignore_eos": True, "stream": True}
    with client.stream("POST", f"{stack.url}/v1/chat/completions", json=body, headers={"x-request-id": "e2e-1"}) as r:
        assert r.status_code == 200
        assert r.headers[REQUEST_ID_HEADER] == "e2e-1"
        parsed = chunks(data_lines(r))
    assert parsed[0]["choices"][0]["delta"]["role"] == "assistant"
    assert parsed[-1]["choices"][0]["finish_reason"] == "length"


def test_a_client_cannot_pin_a_replica(stack, client, route_url, llm_cluster: LLMCluster) -> None:
    for i in range(10):
        session = f"pin-{i}"
        chosen = _router_choice(client, route_url, session)
        other = next(e.replica_id for e in llm_cluster.endpoints if e.replica_id != chosen)
        forged = {"x-session-id": session, REPLICA_HEADER: other, "x-sluice-server": "replica1"}
        response = client.post(f"{stack.url}/v1/completions", json=COMPLETION, headers=forged)
        assert response.headers[REPLICA_HEADER] == chosen


def test_client_disconnect_through_haproxy_aborts_the_engine_request(stack, llm_cluster: LLMCluster) -> None:
    body = {**COMPLETION, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=60) as response:
        lines = stream_lines(response)
        for _ in range(5):
            next(lines)
        replica = next(e for e in llm_cluster.endpoints if e.replica_id == response.headers[REPLICA_HEADER])
    disconnected = time.monotonic()
    while True:
        text = httpx.get(f"{replica.url}/metrics").text
        running = sum(float(v) for v in re.findall(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M))
        if running == 0:
            break
        assert time.monotonic() - disconnected < 1.0, "engine still runs the request 1 s after the disconnect"
        time.sleep(0.02)


def _router_processes(stack: DirectStreamStack) -> list[psutil.Process]:
    prefix = f"ray::ServeReplica:{stack.spec.router_app}:"
    return [p for p in psutil.process_iter(["cmdline"]) if " ".join(p.info["cmdline"] or []).startswith(prefix)]


def test_stopped_routers_fail_closed_within_the_route_timeout(stack, client, llm_cluster: LLMCluster) -> None:
    routers = _router_processes(stack)
    assert len(routers) == 2
    before = engine_requests(llm_cluster.app)
    for process in routers:
        os.kill(process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        response = client.post(f"{stack.url}/v1/completions", json=COMPLETION, headers={"x-session-id": "s"})
        elapsed = time.monotonic() - started
    finally:
        for process in routers:
            os.kill(process.pid, signal.SIGCONT)
        stack.wait_until_serving(replicas=2, routers=2, timeout_s=30)  # health checks may have marked them down
    assert response.status_code == 503
    assert response.headers[SERVE_REASON_HEADER] == REASON_ROUTER_UNREACHABLE
    assert response.json()["error"]["code"] == 503
    assert elapsed < ROUTE_TIMEOUT_S + 0.5
    assert engine_requests(llm_cluster.app) == before, "a replica received a request the router never placed"


def test_killed_routers_fail_closed(stack, client, llm_cluster: LLMCluster) -> None:
    routers = _router_processes(stack)
    assert len(routers) == 2
    before = engine_requests(llm_cluster.app)
    killed = {e.replica_id for e in asyncio.run(list_replica_endpoints(stack.spec.router_app))}
    for process in routers:
        os.kill(process.pid, signal.SIGKILL)
    response = client.post(f"{stack.url}/v1/completions", json=COMPLETION, headers={"x-session-id": "s"})
    assert response.status_code == 503
    assert response.headers[SERVE_REASON_HEADER] == REASON_ROUTER_UNREACHABLE
    assert response.json()["error"]["code"] == 503
    assert engine_requests(llm_cluster.app) == before, "a replica received a request the router never placed"
    # Serve replaces the killed routers: until it notices, it still lists them and HAProxy may still route to them.
    wait_until(
        120,
        lambda: not killed & {e.replica_id for e in wait_for_endpoints(stack.spec.router_app, 2, timeout_s=120)},
        "Serve to replace the killed routers",
        poll_s=0.5,
    )
    stack.wait_until_serving(replicas=2, routers=2, timeout_s=60)
    ok = client.post(f"{stack.url}/v1/completions", json=COMPLETION, headers={"x-session-id": "s"})
    assert ok.status_code == 200, ok.headers


def test_requests_keep_succeeding_with_one_router_killed(stack, client) -> None:
    routers = _router_processes(stack)
    os.kill(routers[0].pid, signal.SIGKILL)
    statuses = []
    for i in range(40):
        statuses.append(client.post(f"{stack.url}/v1/completions", json=COMPLETION, headers={"x-session-id": str(i)}))
        time.sleep(0.05)
    assert [(r.status_code, r.headers.get(SERVE_REASON_HEADER)) for r in statuses] == [(200, None)] * 40
    wait_for_endpoints(stack.spec.router_app, 2, timeout_s=120)  # Serve replaces the killed router
