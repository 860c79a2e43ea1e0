"""sluice policies deciding real DeploymentHandle calls on a 3-replica Ray Serve deployment."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import ray
from ray import serve

from base.waiting import WaitTimeout, wait_until
from routers.ledger_actor import ledger_actor_name
from routers.serve_adapters import request_router_config

pytestmark = pytest.mark.integration

REPLICAS = 3


@serve.deployment(num_replicas=REPLICAS, ray_actor_options={"num_cpus": 0})
class Probe:
    """Streams its replica id; the first item also says how many calls it was serving at start."""

    def __init__(self) -> None:
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.active = 0

    async def stream(self, chunks: int, delay_s: float, headers: dict | None = None):
        self.active += 1
        try:
            yield (self.replica_id, self.active)
            for _ in range(chunks - 1):
                await asyncio.sleep(delay_s)
                yield (self.replica_id, self.active)
        finally:
            self.active -= 1


def _deploy(app: str, policy: str, max_ongoing_requests: int = 16, **kwargs):
    deployment = Probe.options(
        name=f"Probe_{policy}",
        max_ongoing_requests=max_ongoing_requests,
        request_router_config=request_router_config(policy, **kwargs),
    )
    return serve.run(deployment.bind(), name=app, route_prefix=None)


def _call(handle, **options) -> list[tuple[str, int]]:
    return list(handle.options(stream=True, **options).stream.remote(2, 0.0))


@pytest.fixture(scope="module")
def hash_handle(ray_cluster):
    yield _deploy("probe-hash", "consistent_hash")
    serve.delete("probe-hash")


def test_consistent_hash_keeps_a_session_on_one_replica(hash_handle) -> None:
    served = {item[0] for _ in range(50) for item in _call(hash_handle, session_id="team-a-session")}
    assert len(served) == 1


def test_consistent_hash_reads_the_session_header_of_a_headers_argument(hash_handle) -> None:
    stream = hash_handle.options(stream=True).stream
    served = {item[0] for _ in range(20) for item in stream.remote(1, 0.0, headers={"X-Session-Id": "hdr-7"})}
    assert served == {_call(hash_handle, session_id="hdr-7")[0][0]}


def test_consistent_hash_spreads_different_sessions(hash_handle) -> None:
    served = {_call(hash_handle, session_id=f"session-{i}")[0][0] for i in range(40)}
    assert len(served) == REPLICAS


def test_round_robin_cycles(ray_cluster) -> None:
    handle = _deploy("probe-rr", "round_robin")
    try:
        order = [_call(handle)[0][0] for _ in range(4 * REPLICAS)]
        assert len(set(order[:REPLICAS])) == REPLICAS
        assert order == order[:REPLICAS] * 4
    finally:
        serve.delete("probe-rr")


def test_capacity_queue_never_exceeds_capacity(ray_cluster) -> None:
    capacity, calls = 2, 30
    handle = _deploy("probe-cq", "capacity_queue", max_ongoing_requests=capacity)
    try:
        _call(handle)  # creates the deployment's ledger actor from this process's router
        ledger = ray.get_actor(ledger_actor_name("probe-cq", "Probe_capacity_queue"), namespace="sluice")
        before = ray.get(ledger.snapshot.remote(), timeout=60)

        async def burst() -> list[list[tuple[str, int]]]:
            async def one() -> list[tuple[str, int]]:
                return [item async for item in handle.options(stream=True).stream.remote(4, 0.05)]

            return await asyncio.gather(*(one() for _ in range(calls)))

        results = asyncio.run(burst())
        assert all(len(r) == 4 for r in results)
        assert max(active for r in results for _, active in r) <= capacity
        assert len({r[0][0] for r in results}) == REPLICAS

        with contextlib.suppress(WaitTimeout):
            wait_until(10, lambda: not ray.get(ledger.snapshot.remote())["outstanding"], "release", poll_s=0.1)
        after = ray.get(ledger.snapshot.remote())
        assert after["granted"] - before["granted"] >= calls, "every call must have held a ledger token"
        assert after["released"] == after["granted"]
        assert after["outstanding"] == 0 and after["double_releases"] == 0
        assert all(r["in_flight"] == 0 and r["capacity"] == capacity for r in after["replicas"].values())
    finally:
        serve.delete("probe-cq")
