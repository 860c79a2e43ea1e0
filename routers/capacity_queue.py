"""CapacityQueue: admit a request only with a token from the deployment's central capacity ledger.

A token goes to the least-loaded replica with room; when all are full the request waits in the ledger's FIFO (up
to `max_wait_s`, or the caller's own wait for the decision when shorter: HAProxy's HTTP route call then gets
`capacity_timeout`, not its own `router_unreachable`). After `fault_limit` (3) ledger faults, with backoff, a
request falls back to PowerOfTwo without a token. The caller releases a token exactly once; the ledger's reaper
takes back lost ones. A replica that refuses a request gets its token back through `reject`, and the ledger holds it
full until it reports room (a release of one of its tokens) or a short hold passed: the effect Ray gets by leaking
the token until the TTL, without a refusing replica staying one slot short for the whole TTL (THE REJECTION RULE).
Algorithm, faults, constants and THE RESTART BOUND: routers/README.md#capacity_queue.
"""

from __future__ import annotations

import asyncio
import heapq
import random
from collections.abc import Awaitable, Callable, Sequence

from pydantic import Field

from base.contracts import REASON_NO_REPLICA
from routers.capacity_ledger import DEFAULT_TOKEN_TTL_S, CapacityLedger, LedgerClient, UnknownReplicas
from routers.core import (
    DEFAULT_NUM_FALLBACK_REPLICAS,
    CapacityToken,
    Decision,
    NoReplicaAvailable,
    ReplicaView,
    RouteRequest,
    RoutingPolicy,
)
from routers.entry import PolicyContext, PolicyEntry, PolicySettings
from routers.metrics import LEDGER_METRICS
from routers.power_of_two import PowerOfTwo

NAME = "capacity_queue"

# A waiting request re-asks the ledger at least this often, so a hung ledger is noticed within a slice.
WAIT_SLICE_S = 2.0
# Fallback candidates looked at per decision: enough that the two fallbacks are among the least loaded (the
# token's replica already is the least loaded with room), few enough that ranking costs the same at any size.
FALLBACK_SAMPLE = 8
# Past this a queued request is better rejected than kept.
DEFAULT_MAX_WAIT_S = 30.0


class CapacityQueueSettings(PolicySettings):
    max_wait_s: float = Field(DEFAULT_MAX_WAIT_S, gt=0)
    token_ttl_s: float = Field(DEFAULT_TOKEN_TTL_S, gt=0)
    seed: int | None = None


class LocalLedgerClient:
    """A `LedgerClient` over a ledger in this process and event loop."""

    def __init__(self, ledger: CapacityLedger) -> None:
        self.ledger = ledger

    async def acquire(self, replica_ids: Sequence[str], request_id: str, wait_s: float) -> CapacityToken | None:
        return await self.ledger.acquire(replica_ids, request_id, wait_s)

    async def release(self, token_id: str) -> bool:
        return self.ledger.release(token_id)

    async def reject(self, token_id: str) -> bool:
        return self.ledger.reject(token_id)

    async def set_replicas(self, capacities: dict[str, int]) -> None:
        self.ledger.set_replicas(capacities)

    async def snapshot(self) -> dict:
        return self.ledger.snapshot()


class CapacityQueue(RoutingPolicy):
    name = NAME

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
        # This call's own views by id: a concurrent decision may set the policy's to another set across the awaits.
        by_id = self.views_by_id
        if not routable:
            self.counts.record(REASON_NO_REPLICA)
            raise NoReplicaAvailable(REASON_NO_REPLICA)
        loop = asyncio.get_running_loop()
        budget = request.wait_budget_s
        deadline = loop.time() + (self.max_wait_s if budget is None else min(self.max_wait_s, budget))
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
                primary = by_id.get(token.replica_id)
                if primary is None:  # granted on a set another decision pushed meanwhile: not this caller's
                    await self.release(token)
                    self.counts.event("token_outside_set")
                    continue
                reason = "waited" if waiting else "acquired"
                return self._decided(request, self._ranking(primary, routable), reason, token)
            waiting = True

    async def release(self, token: CapacityToken) -> bool:
        try:
            return await self.ledger.release(token.token_id)
        except Exception:
            self.counts.event("release_fault")
            return False

    async def reject(self, token: CapacityToken) -> bool:
        """The token's replica refused the request: the ledger holds it full until it reports room (THE REJECTION
        RULE, routers/README.md#the-capacity-ledger)."""
        try:
            return await self.ledger.reject(token.token_id)
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
        # This call's own capacities and candidates: another decision may change the policy's across the awaits.
        capacities, candidates = self._capacities, self._candidates
        if routable is not self._candidates_of:  # a new routable set: its capacities and ids, once
            capacities = {r.replica_id: r.capacity for r in routable}
            # A tuple, the same object while the set stands: the ledger matches it by identity, in O(1).
            candidates = tuple(capacities)
            self._candidates_of, self._capacities, self._candidates = routable, capacities, candidates
        if capacities is not self._pushed:
            if capacities != self._pushed:
                await self.ledger.set_replicas(capacities)
            self._pushed = capacities  # from now on the identity check says it is pushed
        return await self.ledger.acquire(candidates, request.request_id, wait_s)

    def _ranking(self, primary: ReplicaView, routable: list[ReplicaView]) -> list[list[ReplicaView]]:
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
            self._fallback = PowerOfTwo(seed=self._seed)
            # Share this policy's live counts, so the fallback sees the requests placed here.
            self._fallback.tracker = self.tracker
        return self._fallback


def _build(settings: CapacityQueueSettings, context: PolicyContext) -> CapacityQueue:
    """Over `context.ledger`, else over the ledger actor of the context's deployment (created on first use)."""
    ledger = context.ledger
    if ledger is None:
        # The ledger actor needs Ray; only a policy built without a ledger imports it.
        from routers.ledger_actor import actor_ledger_client

        ledger = actor_ledger_client(context.app, context.deployment, settings.token_ttl_s)
    return CapacityQueue(ledger, max_wait_s=settings.max_wait_s, seed=settings.seed)


async def _refresh_metrics(policy: CapacityQueue, app: str) -> None:
    LEDGER_METRICS.update(app, await policy.ledger_snapshot())


ENTRY = PolicyEntry(
    NAME, CapacityQueueSettings, _build, needs_ledger=True, prefill_side=False, refresh_metrics=_refresh_metrics
)
