"""`sluice bench routers`: decision time per policy, ring rebuild time, ledger round trips, the route agent alone
(`sluice.bench.route_agent`), and kv_aware's rows with its tokenizer (`sluice.bench.kv_decisions`).

Aims (issue 3): ring lookup ≤ 5 µs and rebuild ≤ 50 ms at 1,024 replicas. Issue 13: a decision at 1,024 replicas
≤ 10 µs for round_robin, power_of_two and consistent_hash, ≤ 50 µs for capacity_queue, and no policy's cost
growing with the replica count. A decision's time is this process's CPU time, the best of `REPEATS` runs: what the
decision itself costs, not what else the machine was doing (on a busy 2-core machine wall-clock times of one run
varied by 2x). Round trips to the ledger are wall-clock: they include waiting for it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from routers.capacity_ledger import CapacityLedger
from routers.capacity_queue import NAME as CAPACITY_QUEUE
from routers.capacity_queue import LocalLedgerClient
from routers.consistent_hash import NAME as CONSISTENT_HASH
from routers.core import ReplicaView, RouteRequest, RoutingPolicy
from routers.entry import PolicyContext
from routers.power_of_two import NAME as POWER_OF_TWO
from routers.registry import build_policy
from routers.round_robin import NAME as ROUND_ROBIN
from sluice.bench.route_agent import agent_cpu_per_decision, agent_table

SIZES = (8, 128, 1024)
DECISIONS = 20_000
CAPACITY_DECISIONS = 2_000
REPEATS = 3


def _per_call_us(fn: Callable[[int], object], calls: int) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        start = time.process_time()
        for i in range(calls):
            fn(i)
        best = min(best, time.process_time() - start)
    return best / calls * 1e6


def _views(n: int) -> tuple[ReplicaView, ...]:
    """One views snapshot, a tuple as the router service hands its policy between refreshes."""
    return tuple(ReplicaView(replica_id=f"replica-{i:05d}", capacity=1_000_000) for i in range(n))


def decision_us(policy: RoutingPolicy, n: int, sessions: bool) -> float:
    views = _views(n)
    requests = [RouteRequest(request_id=f"r{i}", session_id=f"s{i}" if sessions else None) for i in range(DECISIONS)]
    policy.rank(views, requests[0])

    def decide(i: int) -> None:
        policy.rank(views, requests[i])
        policy.on_completed(requests[i].request_id, "")

    return _per_call_us(decide, DECISIONS)


def ring_lookup_us(n: int) -> float:
    # The ring's own lookup and rebuild (consistent_hash's methods, not RoutingPolicy's): this bench measures them.
    policy = build_policy(CONSISTENT_HASH, {})
    policy.rank(_views(n), RouteRequest(request_id="warm"))
    keys = [f"session-{i}" for i in range(DECISIONS)]
    return _per_call_us(lambda i: policy.lookup(keys[i]), DECISIONS)


def ring_rebuild_ms(n: int) -> tuple[float, float]:
    """(cold build, rebuild after one replica joins) in ms."""
    ids = [f"replica-{i:05d}" for i in range(n + 1)]
    cold = build_policy(CONSISTENT_HASH, {})
    start = time.perf_counter()
    cold.on_replicas_changed(ids[:n])
    cold_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    cold.on_replicas_changed(ids)
    return cold_ms, (time.perf_counter() - start) * 1e3


async def ledger_round_trip_us(client_factory: Callable[[], object], calls: int) -> float:
    client = client_factory()
    await client.set_replicas({f"replica-{i}": 1_000 for i in range(8)})
    replica_ids = [f"replica-{i}" for i in range(8)]
    start = time.perf_counter()
    for i in range(calls):
        token = await client.acquire(replica_ids, f"r{i}", 0.0)
        await client.release(token.token_id)
    return (time.perf_counter() - start) / calls * 1e6


def capacity_decision_us(n: int) -> float:
    policy = build_policy(CAPACITY_QUEUE, {}, PolicyContext(ledger=LocalLedgerClient(CapacityLedger())))
    views = _views(n)
    requests = [RouteRequest(request_id=f"r{i}") for i in range(CAPACITY_DECISIONS)]

    async def run() -> float:
        await policy.decide(views, RouteRequest(request_id="warm"))
        best = float("inf")
        for _ in range(REPEATS):
            start = time.process_time()
            for request in requests:
                decision = await policy.decide(views, request)
                await policy.release(decision.token)
                policy.on_completed(request.request_id, "")
            best = min(best, time.process_time() - start)
        return best / CAPACITY_DECISIONS * 1e6

    return asyncio.run(run())


def run_router_bench(with_actor: bool = True) -> None:
    print(f"{'policy':<34}" + "".join(f"{f'{n} replicas':>14}" for n in SIZES) + "   (µs per decision)")
    rows: list[tuple[str, Callable[[int], float]]] = [
        (ROUND_ROBIN, lambda n: decision_us(build_policy(ROUND_ROBIN, {}), n, sessions=False)),
        (POWER_OF_TWO, lambda n: decision_us(build_policy(POWER_OF_TWO, {"seed": 0}), n, sessions=False)),
        (f"{CONSISTENT_HASH} (session)", lambda n: decision_us(build_policy(CONSISTENT_HASH, {}), n, sessions=True)),
        (
            f"{CONSISTENT_HASH} (no session)",
            lambda n: decision_us(build_policy(CONSISTENT_HASH, {}), n, sessions=False),
        ),
        (
            f"{CONSISTENT_HASH} bounded c=1.25",
            lambda n: decision_us(build_policy(CONSISTENT_HASH, {"load_factor": 1.25}), n, sessions=True),
        ),
        ("ring lookup alone", ring_lookup_us),
        (f"{CAPACITY_QUEUE} (in-process ledger)", capacity_decision_us),
    ]
    for label, measure in rows:
        print(f"{label:<34}" + "".join(f"{measure(n):>14.1f}" for n in SIZES))
    builds = [ring_rebuild_ms(n) for n in SIZES]
    print(f"{'ring build ms (cold / +1 replica)':<34}" + "".join(f"{f'{c:.1f} / {w:.1f}':>14}" for c, w in builds))
    local = asyncio.run(ledger_round_trip_us(lambda: LocalLedgerClient(CapacityLedger()), 20_000))
    print(f"ledger acquire+release, in-process: {local:.1f} µs")
    if with_actor:
        print(f"ledger acquire+release, Ray actor:  {_actor_round_trip_us():.0f} µs")
    print("\nthe route agent in a process of its own, SPOE NOTIFY frames at fixed rates (transport included):")
    print(agent_table(agent_cpu_per_decision((ROUND_ROBIN, CONSISTENT_HASH))))


def _actor_round_trip_us() -> float:
    from routers.ledger_actor import ActorLedgerClient, get_or_create_ledger
    from sluice.deploy.local_cluster import start_local_cluster, stop_local_cluster

    start_local_cluster()
    try:
        import ray

        handle = get_or_create_ledger("sluice-bench-ledger", token_ttl_s=600)
        ray.get(handle.snapshot.remote(), timeout=120)  # a new actor's worker takes seconds to start
        return asyncio.run(ledger_round_trip_us(lambda: ActorLedgerClient(handle), 500))
    finally:
        stop_local_cluster()
