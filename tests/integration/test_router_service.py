"""The router service on Ray Serve in front of the two real tiny-model replicas of app "llm".

Two consistent-hash router replicas agree on every session, spread unsessioned requests, and name
replicas that really serve under that id on their own port. A capacity_queue router hands out a
ledger token that the chosen replica gives back exactly once, at stream end or at client disconnect.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from base.contracts import (
    CAPACITY_TOKEN_HEADER,
    REPLICA_HEADER,
    REQUEST_ID_HEADER,
    ROUTE_PATH,
    SESSION_HEADER_DEFAULT,
)
from base.route_wire import RouteReply
from base.waiting import WaitTimeout, wait_until
from services.internal_credential import internal_headers
from services.serve_internals import ReplicaEndpoint
from sluice.deploy.apply import delete_apps
from tests.support.llm_cluster import LLMCluster
from tests.support.sse import DONE, stream_lines

pytestmark = pytest.mark.integration

HASH_APP, HASH_PREFIX = "router", "/router"
QUEUE_APP, QUEUE_PREFIX = "router-cq", "/router-cq"
MODEL = "sluice-tiny"
# Long enough (~2 s at ~440 tok/s) that the client disconnects mid-stream.
LONG_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "keep going"}], "max_tokens": 800, "stream": True}
SHORT_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
RELEASE_WITHIN_S = 1.0


@dataclass
class RouterApp:
    prefix: str
    endpoints: list[ReplicaEndpoint]

    def route(self, endpoint: ReplicaEndpoint, session: str | None = None) -> RouteReply:
        headers = {**internal_headers(), REQUEST_ID_HEADER: uuid.uuid4().hex}
        if session is not None:
            headers[SESSION_HEADER_DEFAULT] = session
        reply = httpx.post(f"{endpoint.url}{self.prefix}{ROUTE_PATH}", headers=headers, timeout=10)
        assert reply.status_code == 200, reply.text
        return RouteReply.model_validate(reply.json())


def _deploy(name: str, prefix: str, num_replicas: int, **settings) -> RouterApp:
    from ray import serve

    from services.router.service import router_application
    from services.router.settings import RouterSettings
    from services.serve_internals import wait_for_endpoints

    app = router_application(RouterSettings(**settings), num_replicas)
    serve.run(app, name=name, route_prefix=prefix, blocking=False)
    return RouterApp(prefix, wait_for_endpoints(name, num_replicas, timeout_s=60))


@pytest.fixture(scope="module")
def routers(llm_cluster: LLMCluster) -> Iterator[dict[str, RouterApp]]:
    import ray

    from routers.ledger_actor import LEDGER_NAMESPACE, ledger_actor_name

    target = {"target_app": llm_cluster.app, "target_capacity": llm_cluster.config.deployment.max_ongoing_requests}
    try:
        yield {
            "hash": _deploy(HASH_APP, HASH_PREFIX, 2, policy="consistent_hash", **target),
            "queue": _deploy(QUEUE_APP, QUEUE_PREFIX, 1, policy="capacity_queue", **target),
        }
    finally:
        delete_apps([HASH_APP, QUEUE_APP], frontend_first=False)
        ledger = ledger_actor_name(llm_cluster.app, llm_cluster.config.deployment.name)
        try:
            ray.kill(ray.get_actor(ledger, namespace=LEDGER_NAMESPACE), no_restart=True)
        except ValueError:  # never created
            pass


def _replica_endpoint(llm_cluster: LLMCluster, replica_id: str) -> ReplicaEndpoint:
    return next(e for e in llm_cluster.endpoints if e.replica_id == replica_id)


def test_both_router_replicas_choose_the_same_replica_per_session(
    routers: dict[str, RouterApp], llm_cluster: LLMCluster
) -> None:
    hash_router = routers["hash"]
    assert len({e.port for e in hash_router.endpoints}) == 2
    llm_ids = {e.replica_id for e in llm_cluster.endpoints}
    chosen = set()
    for i in range(20):
        first, second = (hash_router.route(e, f"session-{i}") for e in hash_router.endpoints)
        assert first == second
        assert first.replica_id in llm_ids and set(first.fallbacks) == llm_ids - {first.replica_id}
        chosen.add(first.replica_id)
    assert chosen <= llm_ids


def test_unsessioned_requests_spread_over_both_replicas(routers: dict[str, RouterApp], llm_cluster: LLMCluster) -> None:
    hash_router = routers["hash"]
    chosen = [hash_router.route(hash_router.endpoints[i % 2]).replica_id for i in range(20)]
    assert set(chosen) == {e.replica_id for e in llm_cluster.endpoints}


def test_the_chosen_replica_serves_under_its_id(routers: dict[str, RouterApp], llm_cluster: LLMCluster) -> None:
    hash_router = routers["hash"]
    for session in ("alpha", "beta", "gamma"):
        reply = hash_router.route(hash_router.endpoints[0], session)
        request_id = uuid.uuid4().hex
        response = httpx.post(
            f"{_replica_endpoint(llm_cluster, reply.replica_id).url}/v1/chat/completions",
            json=SHORT_CHAT,
            headers={**internal_headers(), REQUEST_ID_HEADER: request_id, SESSION_HEADER_DEFAULT: session},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        assert response.headers[REPLICA_HEADER] == reply.replica_id
        assert response.headers[REQUEST_ID_HEADER] == request_id


def _ledger_snapshot(llm_cluster: LLMCluster) -> dict:
    import ray

    from routers.ledger_actor import LEDGER_NAMESPACE, ledger_actor_name

    name = ledger_actor_name(llm_cluster.app, llm_cluster.config.deployment.name)
    return ray.get(ray.get_actor(name, namespace=LEDGER_NAMESPACE).snapshot.remote(), timeout=10)


def _wait_until_released(llm_cluster: LLMCluster, released_before: int) -> dict:
    with contextlib.suppress(WaitTimeout):
        wait_until(RELEASE_WITHIN_S, lambda: _ledger_snapshot(llm_cluster)["outstanding"] == 0, "release", poll_s=0.05)
    snapshot = _ledger_snapshot(llm_cluster)
    assert snapshot["outstanding"] == 0, snapshot
    assert snapshot["released"] == released_before + 1, snapshot
    assert snapshot["double_releases"] == snapshot["unknown_releases"] == snapshot["late_releases"] == 0, snapshot
    return snapshot


@pytest.mark.parametrize("ending", ["finished", "disconnected"])
def test_the_capacity_token_is_released_once_by_the_replica(
    routers: dict[str, RouterApp], llm_cluster: LLMCluster, ending: str
) -> None:
    assert llm_cluster.config.deployment.capacity_ledger, "the llm app must be deployed with capacity_ledger=True"
    queue_router = routers["queue"]
    reply = queue_router.route(queue_router.endpoints[0], f"cq-{ending}")
    assert reply.capacity_token and reply.replica_id in {e.replica_id for e in llm_cluster.endpoints}
    before = _ledger_snapshot(llm_cluster)
    assert before["outstanding"] == 1
    assert before["replicas"][reply.replica_id]["in_flight"] == 1

    url = f"{_replica_endpoint(llm_cluster, reply.replica_id).url}/v1/chat/completions"
    headers = {**internal_headers(), CAPACITY_TOKEN_HEADER: reply.capacity_token, "accept-encoding": "identity"}
    with httpx.stream("POST", url, json=LONG_CHAT, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers[REPLICA_HEADER] == reply.replica_id
        lines = stream_lines(response)
        first = [next(line for line in lines if line.startswith("data: ")) for _ in range(3)]
        assert f"data: {DONE}" not in first
        # Mid-stream the token is still held: only the end of the request releases it.
        assert _ledger_snapshot(llm_cluster)["outstanding"] == 1
        if ending == "finished":
            rest = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
            assert rest[-1] == DONE
    # Leaving the `with` block early closes the connection: a client disconnect mid-stream.
    _wait_until_released(llm_cluster, before["released"])
