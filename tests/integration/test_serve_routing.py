"""sluice policies deciding real DeploymentHandle calls on a 3-replica Ray Serve deployment."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import ray
from prometheus_client import REGISTRY
from ray import serve

from base.waiting import WaitTimeout, wait_until
from routers.ledger_actor import ledger_actor_name
from routers.serve_adapters import REPEATED_COMPLETION_EVENT, request_router_config
from services.legacy.handle_path import chosen_stream

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

    async def later(self, value: float, delay_s: float) -> float:
        """`value` after `delay_s`: an argument that keeps a dispatch resolving it for that long."""
        await asyncio.sleep(delay_s)
        return value


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
    serve.delete("probe-hash", _blocking=False)


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
        serve.delete("probe-rr", _blocking=False)


def _ledger_after_release(app: str, deployment: str) -> dict:
    ledger = ray.get_actor(ledger_actor_name(app, deployment), namespace="sluice")
    with contextlib.suppress(WaitTimeout):
        wait_until(10, lambda: not ray.get(ledger.snapshot.remote())["outstanding"], "release", poll_s=0.1)
    return ray.get(ledger.snapshot.remote())


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

        after = _ledger_after_release("probe-cq", "Probe_capacity_queue")
        assert after["granted"] - before["granted"] >= calls, "every call must have held a ledger token"
        assert after["released"] == after["granted"]
        assert after["outstanding"] == 0 and after["double_releases"] == 0
        assert all(r["in_flight"] == 0 and r["capacity"] == capacity for r in after["replicas"].values())
    finally:
        serve.delete("probe-cq", _blocking=False)


def _repeated_completions() -> float:
    labels = {"policy": "capacity_queue", "event": REPEATED_COMPLETION_EVENT}
    return REGISTRY.get_sample_value("sluice_router_events_total", labels) or 0.0


@pytest.fixture(scope="module")
def queue_handle(ray_cluster):
    handle = _deploy("probe-handle-path", "capacity_queue", max_ongoing_requests=4)
    _call(handle)  # creates the deployment's ledger actor from this process's router
    yield handle.options(stream=True).stream
    serve.delete("probe-handle-path", _blocking=False)


def test_the_handle_path_serves_each_call_on_the_replica_it_chose_and_releases_each_token_once(queue_handle) -> None:
    calls, concurrent = 100, 10
    repeated_before = _repeated_completions()

    async def one() -> tuple[str, set[str]]:
        async with chosen_stream(queue_handle, 3, 0.01) as chosen:
            return chosen.replica_id, {replica async for replica, _ in chosen.items}

    async def all_calls() -> list[tuple[str, set[str]]]:
        done: list[tuple[str, set[str]]] = []
        for _ in range(calls // concurrent):
            done += await asyncio.gather(*(one() for _ in range(concurrent)))
        return done

    served = asyncio.run(all_calls())
    assert len(served) == calls and all(served_by == {chosen} for chosen, served_by in served)
    assert len({chosen for chosen, _ in served}) == REPLICAS
    ledger = _ledger_after_release("probe-handle-path", "Probe_capacity_queue")
    assert ledger["granted"] >= calls + 1 and ledger["released"] == ledger["granted"]
    assert ledger["outstanding"] == 0 and ledger["double_releases"] == 0
    assert _repeated_completions() == repeated_before


def test_a_dispatch_left_unawaited_in_its_choice_counts_out_once(queue_handle) -> None:
    """Ray's documented hazard, forced: the choice's context exits while its dispatch still resolves an argument (a
    pending call), and Serve reports the request completed twice; the adapter counts it out once, the ledger's token
    comes back once."""
    calls = 10
    repeated_before = _repeated_completions()
    later = queue_handle.options(stream=False, method_name="later")

    async def unawaited() -> list[str]:
        async with queue_handle.choose_replica(2, 0.01) as selection:
            response = queue_handle.dispatch(selection, 2, later.remote(0.01, 0.3))
        return [replica async for replica, _ in response]

    async def all_calls() -> list[list[str]]:
        return [await unawaited() for _ in range(calls)]

    assert all(len(items) == 2 for items in asyncio.run(all_calls()))
    ledger = _ledger_after_release("probe-handle-path", "Probe_capacity_queue")
    assert ledger["released"] == ledger["granted"] and ledger["double_releases"] == 0
    assert all(replica["in_flight"] == 0 for replica in ledger["replicas"].values())
    wait_until(10, lambda: _repeated_completions() >= repeated_before + calls, "repeated completions", poll_s=0.1)
