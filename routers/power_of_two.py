"""PowerOfTwo: two random candidates, the one with fewer live in-flight requests wins.

Algorithm: sample two distinct replicas uniformly; compare `live_in_flight` (the larger of the
caller's reported count and the requests this policy placed there and has not seen end, counted
at decision time); the lower wins, a tie goes to the first sample (itself random). The loser is
the only fallback tier. O(1) per decision beyond reading the views. Live counts matter: with
counts scraped from metrics, a burst of simultaneous decisions all see the same stale numbers and
herd onto one replica; counting at decision time keeps the maximum load of a burst of M over N
equal replicas near M/N (+ O(log log N)).
Reasons: `single_replica`, `fewer_in_flight`, `tie`. `seed` makes the sampling reproducible.
"""

from __future__ import annotations

import random

from routers.core import ReplicaView, RouteRequest, RoutingPolicy


class PowerOfTwo(RoutingPolicy):
    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        super().__init__()
        self._rng = random.Random(seed)

    def _rank(self, replicas: list[ReplicaView], request: RouteRequest) -> tuple[list[list[ReplicaView]], str]:
        if len(replicas) == 1:
            return [[replicas[0]]], "single_replica"
        first, second = self._rng.sample(replicas, 2)
        first_load, second_load = self.live_in_flight(first), self.live_in_flight(second)
        if second_load < first_load:
            first, second = second, first
        return [[first], [second]], "tie" if first_load == second_load else "fewer_in_flight"
