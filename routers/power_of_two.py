"""PowerOfTwo: two random candidates, the one with fewer live in-flight requests wins; the loser is the fallback.

In-flight counts are live (counted at decision time), so a burst of simultaneous decisions does not herd onto one
replica. Reasons: `single_replica`, `fewer_in_flight`, `tie`; `seed` makes the sampling reproducible.
Semantics and rationale: routers/README.md#power_of_two.
"""

from __future__ import annotations

import random

from routers.core import ReplicaView, RouteRequest, RoutingPolicy
from routers.entry import PolicyContext, PolicyEntry, PolicySettings

NAME = "power_of_two"


class PowerOfTwoSettings(PolicySettings):
    seed: int | None = None


class PowerOfTwo(RoutingPolicy):
    name = NAME

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


def _build(settings: PowerOfTwoSettings, context: PolicyContext) -> PowerOfTwo:
    return PowerOfTwo(seed=settings.seed)


ENTRY = PolicyEntry(NAME, PowerOfTwoSettings, _build)
