"""CapacityQueue: admit a request only with a token from the deployment's central capacity ledger.

Algorithm. `decide` takes the routable replicas, pushes their capacities to the ledger whenever
the set or a capacity changed (and again whenever the ledger says it knows none of them, as a
restarted ledger does), and asks for a token without waiting. The candidate ids go as one tuple per
routable set, so the ledger matches the set by identity and picks in O(log loads) (see
`routers.capacity_ledger`): a decision costs the same at any replica count. Granted: reason
`acquired`. All replicas full: the request queues in the ledger, in slices of at most
`WAIT_SLICE_S`, until a slot is handed to it (reason `waited`) or `max_wait_s` has passed
(`NoReplicaAvailable("capacity_timeout")`). The ranking puts the token's replica first, alone in its tier, then
`DEFAULT_NUM_FALLBACK_REPLICAS` (2, from `routers.core`) other replicas, each in its own tier,
least loaded (live in-flight / capacity) first, ties at random, chosen among at most `FALLBACK_SAMPLE` (8)
random others, so ranking does not grow with the replica count (with up to 9 replicas: among all of them). If
the caller ends up on a fallback tier the token still counts against the primary until released: the error is
on the safe side. The caller releases the token exactly once when the request ends.

Faults. Any exception from the ledger (an error, a call timeout, a dead or restarting actor) is a
fault, counted as event `ledger_fault`. After a fault the request sleeps `backoff_initial_s`
(25 ms), doubling up to `backoff_max_s` (0.5 s), and tries again; after `fault_limit` (3) faults
for the same request it falls back to PowerOfTwo's ranking over the same replicas, without a
token (reason `ledger_fault_fallback`): availability over exact admission, with Serve's
`max_ongoing_requests` still guarding each replica. A fault on release is counted as event
`release_fault` and returns False; the ledger's reaper takes the token back after its TTL.

Constants and why:
- 25 ms first backoff: a transient blip (a dropped call, a GC pause) usually clears within it, and
  it is small against a streamed LLM response. Doubling spreads the retries of many concurrent
  requests so a recovering ledger is not stampeded; the 0.5 s cap bounds a single sleep if
  `fault_limit` is raised (with the default 3 faults the sleeps are 25 ms then 50 ms).
- 3 faults: one or two faults are a blip worth riding out; three in a row are an outage. The cost
  of riding it out is bounded: 75 ms of sleep plus three ledger calls (each at most its call
  timeout) before the request is served anyway.
- `WAIT_SLICE_S` = 2 s: a waiting request re-asks the ledger at least every 2 s, so a ledger that
  hangs (rather than failing fast) is noticed within a slice plus the call timeout; a re-ask puts
  the request at the back of the ledger's FIFO, at most once per 2 s.
- `DEFAULT_MAX_WAIT_S` = 30 s, the default `max_wait_s`: past that a queued request is better
  rejected than kept.

THE RESTART BOUND (see `routers.capacity_ledger`). A restarted ledger is empty: after the policy
pushes the replica set again each replica can be granted up to `capacity` new tokens on top of up
to `capacity` requests admitted before the restart, at most 2 x capacity admitted per replica
until those finish; Serve's `max_ongoing_requests` rejects beyond that. Releases of pre-restart
tokens are unknown ids to the new ledger: counted no-ops that return False.
"""

from __future__ import annotations

import asyncio
import heapq
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from base.contracts import REASON_NO_REPLICA
from routers.capacity_ledger import CapacityLedger, UnknownReplicas
from routers.core import (
    DEFAULT_NUM_FALLBACK_REPLICAS,
    CapacityToken,
    Decision,
    NoReplicaAvailable,
    ReplicaView,
    RouteRequest,
    RoutingPolicy,
)

WAIT_SLICE_S = 2.0
# Fallback candidates looked at per decision: enough that the two fallbacks are among the least loaded (the
# token's replica already is the least loaded with room), few enough that ranking costs the same at any size.
FALLBACK_SAMPLE = 8
DEFAULT_MAX_WAIT_S = 30.0


class LedgerClient(Protocol):
    """How the policy talks to the ledger: in-process (`LocalLedgerClient`) or through the actor."""

    async def acquire(self, replica_ids: Sequence[str], request_id: str, wait_s: float) -> CapacityToken | None: ...

    async def release(self, token_id: str) -> bool: ...

    async def set_replicas(self, capacities: dict[str, int]) -> None: ...

    async def snapshot(self) -> dict: ...


class LocalLedgerClient:
    """A `LedgerClient` over a ledger in this process and event loop."""

    def __init__(self, ledger: CapacityLedger) -> None:
        self.ledger = ledger

    async def acquire(self, replica_ids: Sequence[str], request_id: str, wait_s: float) -> CapacityToken | None:
        return await self.ledger.acquire(replica_ids, request_id, wait_s)

    async def release(self, token_id: str) -> bool:
        return self.ledger.release(token_id)

    async def set_replicas(self, capacities: dict[str, int]) -> None:
        self.ledger.set_replicas(capacities)

    async def snapshot(self) -> dict:
        return self.ledger.snapshot()


class CapacityQueue(RoutingPolicy):
    name = "capacity_queue"

    def __init__(
        self,
        ledger: LedgerClient,
        max_wait_s: float = DEFAULT_MAX_WAIT_S,
        fault_limit: int = 3,
        backoff_initial_s: float = 0.025,
        backoff_max_s: float = 0.5,
        seed: int | None = None,
        *,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        super().__init__()
        self.ledger = ledger
        self.max_wait_s = max_wait_s
        self.fault_limit = fault_limit
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._seed = seed
        self._rng = random.Random(seed)
        self._sleep = sleep
        self._pushed: dict[str, int] | None = None
        # The routable list the cached capacities and candidate ids were built from.
        self._candidates_of: list[ReplicaView] | None = None
        self._capacities: dict[str, int] = {}
        self._candidates: tuple[str, ...] = ()
        self._fallback: RoutingPolicy | None = None

    async def decide(self, replicas: Sequence[ReplicaView], request: RouteRequest) -> Decision:
        routable = self._routable(replicas)
        if not routable:
            self.counts.record(REASON_NO_REPLICA)
            raise NoReplicaAvailable(REASON_NO_REPLICA)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_wait_s
        faults = 0
        backoff = self.backoff_initial_s
        waiting = False
        while True:
            wait_s = 0.0
            if waiting:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    self.counts.record("capacity_timeout")
                    raise NoReplicaAvailable("capacity_timeout")
                wait_s = min(WAIT_SLICE_S, remaining)
            try:
                token = await self._acquire(routable, request, wait_s)
            except Exception as error:
                faults += 1
                self.counts.event("ledger_fault")
                if isinstance(error, UnknownReplicas):
                    self._pushed = None
                if faults >= self.fault_limit:
                    ranking, _ = self._power_of_two()._rank(routable, request)
                    return self._decided(request, ranking, "ledger_fault_fallback", None)
                await self._sleep(backoff)
                backoff = min(2 * backoff, self.backoff_max_s)
                continue
            if token is not None:
                reason = "waited" if waiting else "acquired"
                return self._decided(request, self._ranking(token, routable), reason, token)
            waiting = True

    async def release(self, token: CapacityToken) -> bool:
        try:
            return await self.ledger.release(token.token_id)
        except Exception:
            self.counts.event("release_fault")
            return False

    async def ledger_snapshot(self) -> dict | None:
        """The ledger's state (`CapacityLedger.snapshot`) for the router's metrics; None when the ledger does not
        answer. A scrape is no decision: nothing is counted or retried."""
        try:
            return await self.ledger.snapshot()
        except Exception:
            return None

    def _rank(self, replicas: list[ReplicaView], request: RouteRequest) -> tuple[list[list[ReplicaView]], str]:
        """The synchronous ranking takes no token: PowerOfTwo's over the same replicas."""
        return self._power_of_two()._rank(replicas, request)

    async def _acquire(self, routable: list[ReplicaView], request: RouteRequest, wait_s: float) -> CapacityToken | None:
        if routable is not self._candidates_of:  # a new routable set: its capacities and ids, once
            self._candidates_of = routable
            self._capacities = {r.replica_id: r.capacity for r in routable}
            # A tuple, the same object while the set stands: the ledger matches it by identity, in O(1).
            self._candidates = tuple(self._capacities)
        if self._capacities is not self._pushed:
            if self._capacities != self._pushed:
                await self.ledger.set_replicas(self._capacities)
            self._pushed = self._capacities  # from now on the identity check says it is pushed
        return await self.ledger.acquire(self._candidates, request.request_id, wait_s)

    def _ranking(self, token: CapacityToken, routable: list[ReplicaView]) -> list[list[ReplicaView]]:
        primary = self.views_by_id[token.replica_id]  # the ledger grants only on the candidates: routable ids
        sample = FALLBACK_SAMPLE + 1  # the primary may be among them
        pool = routable if len(routable) <= sample else self._rng.sample(routable, sample)
        others = heapq.nsmallest(
            DEFAULT_NUM_FALLBACK_REPLICAS,
            (r for r in pool if r is not primary),
            key=lambda r: (self.live_in_flight(r) / max(r.capacity, 1), self._rng.random()),
        )
        return [[primary]] + [[r] for r in others]

    def _decided(
        self, request: RouteRequest, ranking: list[list[ReplicaView]], reason: str, token: CapacityToken | None
    ) -> Decision:
        self.counts.record(reason)
        decision = Decision(ranking=ranking, reason=reason, token=token)
        self.tracker.place(request.request_id, decision.ranked_ids)
        return decision

    def _power_of_two(self) -> RoutingPolicy:
        if self._fallback is None:
            from routers.power_of_two import PowerOfTwo

            self._fallback = PowerOfTwo(seed=self._seed)
            # Share this policy's live counts, so the fallback sees the requests placed here.
            self._fallback.tracker = self.tracker
        return self._fallback
