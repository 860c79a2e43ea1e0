"""A capacity ledger's candidate set: its members with room, bucketed by load, so the least-loaded one is found in O(1)
whatever the replica count (routers/README.md#the-capacity-ledger)."""

from __future__ import annotations

import heapq
import random


class CandidateSet:
    """One candidate set's members with room, bucketed by load (in_flight / capacity), kept current by `move`."""

    def __init__(self, key: tuple[str, ...], capacity: dict[str, int], in_flight: dict[str, int]) -> None:
        self.key = key
        self.alive = True  # False once the ledger dropped it: it no longer sees grants and releases
        self.members = {r: None for r in key if r in capacity}  # known candidates, deduplicated, in order
        self._load_of: dict[str, float] = {}
        # Each bucket a list (a random member in O(1)) and each member's index in its list (removal in O(1)).
        self._buckets: dict[float, list[str]] = {}
        self._index: dict[str, int] = {}
        # A min-heap of bucket loads; a load whose bucket emptied stays until it reaches the top.
        self._loads: list[float] = []
        for replica_id in self.members:
            self.move(replica_id, in_flight.get(replica_id, 0), capacity[replica_id])

    def pick(self, rng: random.Random) -> str | None:
        """The least-loaded member with room, a random one among equals; None when all are full."""
        while self._loads:
            bucket = self._buckets.get(self._loads[0])
            if bucket is not None:
                return bucket[0] if len(bucket) == 1 else rng.choice(bucket)
            heapq.heappop(self._loads)
        return None

    def move(self, replica_id: str, in_flight: int, capacity: int) -> None:
        """The replica's in-flight count changed: put it in the bucket of its new load (none when full)."""
        if replica_id not in self.members:
            return
        old = self._load_of.pop(replica_id, None)
        if old is not None:
            bucket = self._buckets[old]
            last = bucket.pop()
            i = self._index.pop(replica_id)
            if last != replica_id:
                bucket[i] = last
                self._index[last] = i
            if not bucket:
                del self._buckets[old]
        if in_flight >= capacity:
            return
        load = in_flight / capacity
        bucket = self._buckets.get(load)
        if bucket is None:
            bucket = self._buckets[load] = []
            # Rebuild the heap once stale loads outnumber live ones, so it stays O(live buckets).
            if len(self._loads) >= 2 * len(self._buckets):
                self._loads = list(self._buckets)
                heapq.heapify(self._loads)
            else:
                heapq.heappush(self._loads, load)
        self._load_of[replica_id] = load
        self._index[replica_id] = len(bucket)
        bucket.append(replica_id)
