"""Router faults in front of the real vLLM replicas: real HAProxy + syncer, the session's tiny-model replicas,
and fault-injecting stand-in routers (a real router never answers garbage, so the faulty one is a stand-in).

Fail closed: every fault is a 503 with its reason and no engine receives the request. Fail open: the same
faults are load-balanced to a real replica, which streams a normal completion marked `x-serve-fallback`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from base.contracts import (
    REASON_NO_REPLICA,
    REASON_ROUTER_NON_200,
    REASON_ROUTER_UNREACHABLE,
    REASON_UNKNOWN_REPLICA_ID,
    REASON_UNPARSEABLE_REPLICA_ID,
    REPLICA_HEADER,
    REQUEST_ID_HEADER,
    SERVE_FALLBACK_HEADER,
    SERVE_REASON_HEADER,
)
from infra.haproxy.apps import AppRoute
from services.internal_credential import internal_credential
from services.serve_internals import list_replica_endpoints
from tests.integration.standin_plane.plane import Plane, start_plane, stop_plane
from tests.integration.standin_plane.standins import (
    OPEN_ROUTER_PREFIX,
    ROUTE_TIMEOUT_S,
    LoopThread,
    RouterBehavior,
    RouterStandIn,
    assert_fail_closed,
    rearm_stall,
)
from tests.support.llm_cluster import LLMCluster
from tests.support.sse import chunks, data_lines
from tests.support.vllm_metrics import engine_requests

pytestmark = pytest.mark.integration

COMPLETION = {"model": "sluice-tiny", "prompt": "ka lo", "max_tokens": 4, "ignore_eos": True, "stream": True}
FAULTS = [
    ("http_500", REASON_ROUTER_NON_200),
    ("garbage", REASON_UNPARSEABLE_REPLICA_ID),
    ("unknown", REASON_UNKNOWN_REPLICA_ID),
    ("no_replica", REASON_NO_REPLICA),
    ("stall", REASON_ROUTER_UNREACHABLE),
    ("killed", REASON_ROUTER_UNREACHABLE),
]


@dataclass
class FaultEnv:
    loop: LoopThread
    behavior: RouterBehavior
    routers: list[RouterStandIn]
    closed: Plane
    open: Plane
    replica_ids: set[str]


@pytest.fixture(scope="module")
def env(llm_cluster: LLMCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultEnv]:
    loop = LoopThread()
    replicas = asyncio.run(list_replica_endpoints(llm_cluster.app))
    behavior = RouterBehavior(replica_ids=[e.replica_id for e in replicas])
    rearm_stall(loop, behavior)
    routers = [RouterStandIn("faulty-router-a", behavior), RouterStandIn("faulty-router-b", behavior)]
    planes: list[Plane] = []
    try:
        for router in routers:
            loop.run(router.start())
        endpoints = [r.endpoint for r in routers]
        for app in (
            AppRoute(name=llm_cluster.app),
            AppRoute(name=f"{llm_cluster.app}-open", fail_open=True, router_route_prefix=OPEN_ROUTER_PREFIX),
        ):
            # Real replicas behind it: the plane sends the cluster's internal credential like a frontend.
            workdir = tmp_path_factory.mktemp("haproxy")
            credential = internal_credential()
            planes.append(start_plane(loop, workdir, app, replicas, endpoints, internal_credential=credential))
        yield FaultEnv(loop, behavior, routers, planes[0], planes[1], {e.replica_id for e in replicas})
    finally:
        rearm_stall(loop, behavior)
        for plane in planes:
            stop_plane(plane)
        for router in routers:
            loop.run(router.stop())
        loop.close()


def _post(env: FaultEnv, plane: Plane, mode: str) -> tuple[httpx.Response, list[dict], float]:
    """One streamed completion through `plane` with the routers in `mode`; routers are healthy again after."""
    env.behavior.mode = "choose" if mode == "killed" else mode
    if mode == "killed":
        for router in env.routers:
            env.loop.run(router.stop())
    started = time.monotonic()
    try:
        url = f"{plane.url}/v1/completions"
        with httpx.Client(timeout=30) as client, client.stream("POST", url, json=COMPLETION) as r:
            if r.status_code == 200:
                parsed = chunks(data_lines(r))
            else:
                parsed = []
                r.read()
        return r, parsed, time.monotonic() - started
    finally:
        env.behavior.mode = "choose"
        rearm_stall(env.loop, env.behavior)
        if mode == "killed":
            for router in env.routers:
                env.loop.run(router.start())  # same port again
            for p in (env.closed, env.open):
                p.wait_synced(timeout_s=15)


@pytest.mark.parametrize(("mode", "reason"), FAULTS)
def test_fault_fails_closed_and_no_engine_sees_the_request(
    env: FaultEnv, llm_cluster: LLMCluster, mode: str, reason: str
) -> None:
    before = engine_requests(llm_cluster.app)
    response, _, elapsed = _post(env, env.closed, mode)
    assert_fail_closed(response, reason)
    if mode == "stall":
        assert ROUTE_TIMEOUT_S * 0.9 <= elapsed < ROUTE_TIMEOUT_S + 0.5, elapsed
    assert engine_requests(llm_cluster.app) == before, "a replica received a request the router did not place"


@pytest.mark.parametrize(("mode", "reason"), FAULTS)
def test_fault_on_a_fail_open_app_streams_from_a_real_replica(env: FaultEnv, mode: str, reason: str) -> None:
    response, parsed, _ = _post(env, env.open, mode)
    assert response.status_code == 200, (response.status_code, response.headers)
    assert response.headers[SERVE_FALLBACK_HEADER] == reason
    assert SERVE_REASON_HEADER not in response.headers
    assert response.headers[REPLICA_HEADER] in env.replica_ids
    assert parsed[-1]["choices"][0]["finish_reason"] == "length"


def test_a_healthy_router_choice_is_served_by_that_real_replica(env: FaultEnv) -> None:
    for plane in (env.closed, env.open):
        response, parsed, _ = _post(env, plane, "choose")
        assert response.status_code == 200
        assert SERVE_FALLBACK_HEADER not in response.headers
        chosen = env.behavior.decisions[response.headers[REQUEST_ID_HEADER]]
        assert response.headers[REPLICA_HEADER] == chosen
        assert parsed[-1]["choices"][0]["finish_reason"] == "length"
