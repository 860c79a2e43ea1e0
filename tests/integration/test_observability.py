"""Observability of a running stack: Prometheus finds every router and replica through the frontend, and every
metric the shipped dashboard queries is exported by some component.

Two setups: the session's tiny-model replicas behind a capacity_queue stack (real Serve ports, a real route agent
beside each router's Serve port, a real ledger), and a stand-in data plane (HAProxy and its syncer over stand-in
replicas and routers) whose routers can be made to refuse and whose replicas can move.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import httpx
import pytest

from base.contracts import REASON_NO_REPLICA, REASON_UNKNOWN_REPLICA_ID, SERVE_REASON_HEADER
from base.waiting import wait_until
from infra.haproxy.config import PROMETHEUS_PATH, SLUICE_METRICS_PATH
from infra.haproxy.spoe import AGENT_BACKEND
from infra.observability.dashboard import load_dashboard, metric_names
from infra.observability.targets import (
    APP_LABEL,
    METRICS_PATH_LABEL,
    REPLICA_LABEL,
    ROLE_LABEL,
    ROLE_REPLICA,
    ROLE_ROUTER,
)
from infra.prometheus_config import metrics_address, prometheus_config
from services.serve_internals import ReplicaEndpoint, list_replica_endpoints
from tests.integration.standin_plane.plane import Env, running_env
from tests.support.frontend_metrics import frontend_counts
from tests.support.llm_cluster import LLMCluster, direct_stack
from tests.support.sse import chunks, data_lines

pytestmark = pytest.mark.integration

ROUTER_APP = "llm-obs-router"
STREAM = {"model": "sluice-tiny", "prompt": "ka lo", "max_tokens": 8, "ignore_eos": True, "stream": True}
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)[{ ]", re.M)
_TYPE = re.compile(r"^# TYPE (\S+) (\w+)$", re.M)
# The series a declared family's samples carry, by its type (a family declared before its first sample exports
# its names too: a counter labelled by reason has no sample until the first such event).
_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}


def exported_names(text: str) -> set[str]:
    """Metric names in a Prometheus text exposition: every sample's, and every declared family's."""
    names = set(_SAMPLE.findall(text))
    for family, kind in _TYPE.findall(text):
        names.update(family + suffix for suffix in _SUFFIXES.get(kind, ("",)))
    return names


def discovered(metrics_port_address: str, role: str | None = None) -> list[dict]:
    """The frontend's target groups, fetched from the URL the rendered Prometheus config names."""
    jobs = prometheus_config([metrics_port_address])["scrape_configs"]
    urls = [source["url"] for job in jobs for source in job.get("http_sd_configs", [])]
    url = next(u for u in urls if u.endswith(f"={role}")) if role else urls[0].split("?")[0]
    response = httpx.get(url, timeout=5)
    response.raise_for_status()
    return response.json()


def by_replica(groups: list[dict]) -> dict[str, tuple[str, str]]:
    """Replica (or router) id -> (address, metrics path) of each target group."""
    return {g["labels"][REPLICA_LABEL]: (g["targets"][0], g["labels"][METRICS_PATH_LABEL]) for g in groups}


def _address(endpoint: ReplicaEndpoint) -> str:
    return f"{endpoint.host}:{endpoint.port}"


@pytest.fixture(scope="module")
def stack(llm_cluster: LLMCluster):
    with direct_stack(llm_cluster, router_name=ROUTER_APP, policy="capacity_queue", check_inter_s=1.0) as started:
        yield started


@pytest.fixture(scope="module")
def metrics_port_address(stack) -> str:
    return metrics_address(stack.spec.haproxy_settings())


@pytest.fixture(scope="module")
def streamed(stack) -> None:
    """A few streamed completions, so the engines' latency histograms and the ledger hold samples."""
    for _ in range(3):
        with httpx.stream("POST", f"{stack.url}/v1/completions", json=STREAM, timeout=60) as response:
            assert response.status_code == 200
            assert chunks(data_lines(response))[-1]["choices"][0]["finish_reason"] == "length"


def test_the_frontend_lists_every_live_replica_and_router_where_its_metrics_are(
    stack, llm_cluster, metrics_port_address
) -> None:
    replicas = asyncio.run(list_replica_endpoints(llm_cluster.app))
    routers = asyncio.run(list_replica_endpoints(ROUTER_APP))
    wait_until(
        10,
        lambda: set(by_replica(discovered(metrics_port_address, ROLE_ROUTER))) == {r.replica_id for r in routers},
        "the router targets to be synced",
        poll_s=0.05,
    )
    assert by_replica(discovered(metrics_port_address, ROLE_REPLICA)) == {
        r.replica_id: (_address(r), "/metrics") for r in replicas
    }
    # A router's target is its Serve port (its metrics), not the route agent HAProxy's route calls go to.
    assert by_replica(discovered(metrics_port_address, ROLE_ROUTER)) == {
        r.replica_id: (_address(r), f"/{ROUTER_APP}/metrics") for r in routers
    }
    stats = stack.runtime.show_stat()
    assert all(stats[(AGENT_BACKEND, r.replica_id)].addr != _address(r) for r in routers)
    everything = discovered(metrics_port_address)
    assert {g["labels"][ROLE_LABEL] for g in everything} == {ROLE_ROUTER, ROLE_REPLICA}
    assert {g["labels"][APP_LABEL] for g in everything} == {llm_cluster.app}
    assert httpx.get(f"http://{metrics_port_address}/sluice/targets?role=nope", timeout=5).status_code == 400


def test_every_metric_the_dashboard_queries_is_exported_by_the_running_stack(
    stack, llm_cluster, metrics_port_address, streamed
) -> None:
    scraped: dict[str, set[str]] = {}
    for path in (PROMETHEUS_PATH, SLUICE_METRICS_PATH):
        scraped[f"frontend {path}"] = exported_names(httpx.get(f"http://{metrics_port_address}{path}", timeout=5).text)
    groups = discovered(metrics_port_address)
    assert len(groups) == len(llm_cluster.endpoints) + stack.spec.routers
    for group in groups:
        url = f"http://{group['targets'][0]}{group['labels'][METRICS_PATH_LABEL]}"
        response = httpx.get(url, timeout=10)
        response.raise_for_status()
        scraped[f"{group['labels'][ROLE_LABEL]} {group['labels'][REPLICA_LABEL]}"] = exported_names(response.text)
    exported = set().union(*scraped.values())
    queried = set().union(*(metric_names(expr) for expr in load_dashboard().exprs()))
    assert queried, "the dashboard queries nothing"
    assert queried <= exported, f"queried but exported by no component: {sorted(queried - exported)}"
    # The router exports its ledger's tokens, held and free, for every replica.
    router = next(g for g in groups if g["labels"][ROLE_LABEL] == ROLE_ROUTER)
    text = httpx.get(f"http://{router['targets'][0]}{router['labels'][METRICS_PATH_LABEL]}", timeout=10).text
    for endpoint in llm_cluster.endpoints:
        for state in ("held", "free"):
            assert f'replica="{endpoint.replica_id}",state="{state}"' in text, (endpoint.replica_id, state)


# The stand-in data plane: routers that refuse on demand, replicas that move.
@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with running_env(tmp_path_factory.mktemp("haproxy")) as started:
        yield started


def _unrouted(env: Env) -> dict[str, int]:
    return frontend_counts(env.plane.haproxy.settings.prometheus_port, "sluice_frontend_unrouted_total")


def test_fail_closed_503s_are_counted_by_their_reason(env: Env) -> None:
    before = _unrouted(env)
    try:
        for mode, reason in (("no_replica", REASON_NO_REPLICA), ("unknown", REASON_UNKNOWN_REPLICA_ID)):
            env.behavior.mode = mode
            for _ in range(2):
                response = httpx.post(f"{env.plane.url}/v1/completions", json={"prompt": "x"}, timeout=10)
                assert (response.status_code, response.headers[SERVE_REASON_HEADER]) == (503, reason)
    finally:
        env.behavior.mode = "choose"
    after = _unrouted(env)
    assert after[REASON_NO_REPLICA] - before.get(REASON_NO_REPLICA, 0) == 2
    assert after[REASON_UNKNOWN_REPLICA_ID] - before.get(REASON_UNKNOWN_REPLICA_ID, 0) == 2


def test_a_moved_replica_is_discovered_at_its_new_address_and_a_leaving_one_no_more(env: Env) -> None:
    plane = env.plane
    address = metrics_address(plane.haproxy.settings)
    routers = {r.replica_id: (_address(r), "/metrics") for r in plane.routers}
    assert by_replica(discovered(address, ROLE_ROUTER)) == routers
    original = list(plane.replicas)
    # r2's id now served at r1's port (as a replaced replica comes back on a new port).
    moved = env.r2.endpoint.model_copy(update={"port": env.r1.port})
    try:
        plane.replicas[:] = [env.r1.endpoint, moved]
        wait_until(
            5,
            lambda: by_replica(discovered(address, ROLE_REPLICA)).get("r2", ("",))[0] == _address(moved),
            "r2 to be listed at its new address",
            poll_s=0.05,
        )
        plane.replicas[:] = [env.r1.endpoint]
        wait_until(
            5, lambda: set(by_replica(discovered(address, ROLE_REPLICA))) == {"r1"}, "r2 to be unlisted", poll_s=0.05
        )
    finally:
        plane.replicas[:] = original
        plane.wait_synced()
    assert set(by_replica(discovered(address, ROLE_REPLICA))) == {"r1", "r2"}
