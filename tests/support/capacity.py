"""Replica views, requests and a capacity_queue policy over a ledger, for the capacity tests."""

from __future__ import annotations

from routers.capacity_ledger import CapacityLedger
from routers.capacity_queue import CapacityQueue, LocalLedgerClient
from routers.core import ReplicaView, RouteRequest

CAPACITIES = {"a": 2, "b": 3, "c": 5}


def views(capacities: dict[str, int] = CAPACITIES) -> list[ReplicaView]:
    return [ReplicaView(replica_id=r, capacity=c) for r, c in capacities.items()]


def request(n: int | str) -> RouteRequest:
    return RouteRequest(request_id=f"req-{n}")


def queue(ledger: CapacityLedger, **kwargs) -> CapacityQueue:
    return CapacityQueue(LocalLedgerClient(ledger), seed=0, **kwargs)
