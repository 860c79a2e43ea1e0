"""CapacityLedger: one central count of in-flight requests per replica against its capacity. No Ray import.

`acquire` grants a token on the least-loaded candidate with room, or queues the caller FIFO until a slot is handed
to it (a request that waited keeps its place, its ticket, when its caller asks again after a wait slice); `release`
is exactly-once (repeats, unknown and late releases are counted no-ops); `reject` gives back the token of a request
its replica refused and holds that replica full until it reports room (THE REJECTION RULE);
`reap` takes back tokens older than `token_ttl_s`, and those of a replica out of the set for `gone_after_s` (it
died: its requests cannot end there, and a Serve replica's id never comes back). A decision costs the same at any
replica count. State is in memory only: after a restart at most 2 x capacity is admitted per replica until older
requests finish (THE RESTART BOUND). Algorithm, cost, constants and why: routers/README.md#the-capacity-ledger.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from routers.capacity_candidates import CandidateSet
from routers.core import CapacityToken

# Far longer than any legitimate request: only tokens whose release was lost are reaped.
DEFAULT_TOKEN_TTL_S = 600.0
# Finished token ids remembered to tell a double release from an unknown one (~10-20 MB).
RELEASED_MEMORY = 100_000
# Queue places remembered for requests still waiting (or given up): far more than ever wait at once.
MAX_TICKETS = 100_000
DEFAULT_REAP_INTERVAL_S = 10.0
# A replica out of the set this long is gone, and its tokens with it: past a membership blip (a replica marked down
# and back within a few health checks), well before the TTL (a killed replica's tokens held the soak's ledger).
DEFAULT_GONE_AFTER_S = 30.0
# How long a replica that refused a request is held full when none of its tokens ends first: its room was taken by
# requests the ledger does not meter (another caller's), and those of an LLM run for seconds.
DEFAULT_REJECT_HOLD_S = 5.0
# Registered candidate sets (one per router view, per narrowed frontend set), least recently used dropped first.
MAX_CANDIDATE_SETS = 16

_RELEASED = "released"
_REAPED = "reaped"


class LedgerClient(Protocol):
    """How the capacity_queue policy talks to the ledger: in-process (`capacity_queue.LocalLedgerClient`) or through
    the actor (`ledger_actor.ActorLedgerClient`)."""

    async def acquire(self, replica_ids: Sequence[str], request_id: str, wait_s: float) -> CapacityToken | None: ...

    async def release(self, token_id: str) -> bool: ...

    async def reject(self, token_id: str) -> bool: ...

    async def set_replicas(self, capacities: dict[str, int]) -> None: ...

    async def snapshot(self) -> dict: ...


class UnknownReplicas(LookupError):
    """None of the requested replicas is known: the ledger is new (restarted) or the set is stale.

    The caller should push its replica set with `set_replicas` and try again."""


@dataclass(slots=True)
class _Grant:
    replica_id: str
    issued_at: float


@dataclass(slots=True)
class _Waiter:
    candidates: CandidateSet
    request_id: str
    future: asyncio.Future[CapacityToken] = field(repr=False)


class CapacityLedger:
    """In-flight tokens per replica against capacity, for one deployment. Single event loop only."""

    def __init__(
        self,
        token_ttl_s: float = DEFAULT_TOKEN_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        seed: int | None = None,
        reject_hold_s: float = DEFAULT_REJECT_HOLD_S,
        gone_after_s: float = DEFAULT_GONE_AFTER_S,
    ) -> None:
        self.token_ttl_s = token_ttl_s
        self.reject_hold_s = reject_hold_s
        self.gone_after_s = gone_after_s
        # Replicas that left the set, since when (their tokens go `gone_after_s` later).
        self._left_at: dict[str, float] = {}
        self._clock = clock
        self._rng = random.Random(seed)
        self._capacity: dict[str, int] = {}
        self._in_flight: dict[str, int] = {}
        self._open = 0  # replicas with room
        # Replicas held full since they refused a request, until when (THE REJECTION RULE).
        self._held_full: dict[str, float] = {}
        # Least recently used first. A plain dict: iterating an OrderedDict's values hashes every key, and a
        # tuple's hash is O(len) each time.
        self._sets: dict[tuple[str, ...], CandidateSet] = {}
        # The tuple the last acquire passed and its set, matched by identity: a tuple cannot change.
        self._last_ids: tuple[str, ...] | None = None
        self._last_set: CandidateSet | None = None
        # Outstanding tokens in issue order (the clock is monotonic), so reaping stops early.
        self._grants: dict[str, _Grant] = {}
        self._finished: OrderedDict[str, str] = OrderedDict()
        # By (ticket, arrival): `_dispatch` serves them in ticket order.
        self._waiters: dict[tuple[int, int], _Waiter] = {}
        self._next_waiter = 0
        # The ticket of each request that has waited: its place in the queue, kept across the caller's wait slices
        # (a caller re-asks every few seconds: `CapacityQueue`'s `WAIT_SLICE_S`) until it is granted.
        self._tickets: OrderedDict[str, int] = OrderedDict()
        self.granted = 0
        self.released = 0
        self.double_releases = 0
        self.unknown_releases = 0
        self.late_releases = 0
        self.reaped = 0
        self.rejected = 0

    def set_replicas(self, capacities: dict[str, int]) -> None:
        """Replace the replica set. Replicas left out get no new tokens; their tokens stay until released or reaped
        (and still count if the replica comes back within `gone_after_s`)."""
        now = self._clock()
        for replica_id in self._capacity.keys() - capacities.keys():
            self._left_at.setdefault(replica_id, now)
        for replica_id in capacities.keys() & self._left_at.keys():
            del self._left_at[replica_id]
        self._capacity = {replica_id: max(capacity, 0) for replica_id, capacity in capacities.items()}
        self._held_full = {r: until for r, until in self._held_full.items() if r in self._capacity}
        self._open = sum(self.in_flight(r) < self._room(r) for r in self._capacity)
        for candidates in self._sets.values():
            candidates.alive = False
        self._sets.clear()
        self._last_ids = self._last_set = None
        self._dispatch()

    async def acquire(self, replica_ids: Sequence[str], request_id: str, wait_s: float = 0.0) -> CapacityToken | None:
        """A token on the least-loaded candidate with room; else wait up to `wait_s` for one; else None.

        Raises `UnknownReplicas` when none of the candidates is a current replica. Pass the same tuple
        each time the set is the same: it is then matched in O(1). A request (`request_id`) that waited before and
        asks again waits at its first place in the queue, ahead of every request that queued after it."""
        if self._held_full:
            self._end_holds(self._clock())
        candidates = self._candidate_set(replica_ids)
        if not candidates.members:
            raise UnknownReplicas(f"none of {len(replica_ids)} replicas is known to the ledger")
        # A free slot here means no waiter can use it (each freed slot goes to the waiters first, `_dispatch`).
        replica_id = candidates.pick(self._rng)
        if replica_id is not None:
            self._tickets.pop(request_id, None)
            return self._grant(replica_id)
        if wait_s <= 0:
            return None
        return await self._wait(candidates, wait_s, request_id)

    def release(self, token_id: str) -> bool:
        """Give back a token: True the first time, a counted no-op (False) after that."""
        grant = self._grants.pop(token_id, None)
        if grant is None:
            earlier = self._finished.get(token_id)
            if earlier == _RELEASED:
                self.double_releases += 1
            elif earlier == _REAPED:
                self.late_releases += 1
            else:
                self.unknown_releases += 1
            return False
        self.released += 1
        if grant.replica_id in self._held_full:  # a request ended there: it has room
            self._set_held(grant.replica_id, None)
        self._finish(token_id, grant, _RELEASED)
        self._dispatch()
        return True

    def reject(self, token_id: str) -> bool:
        """The token's replica refused its request: give the token back and hold the replica full until one of its
        tokens is released or `reject_hold_s` passed. True the first time; an unknown token is a release no-op."""
        grant = self._grants.pop(token_id, None)
        if grant is None:
            return self.release(token_id)
        self.rejected += 1
        self._set_held(grant.replica_id, self._clock() + self.reject_hold_s)
        self._finish(token_id, grant, _RELEASED)
        return True

    def reap(self, now: float | None = None) -> int:
        """Take back every token older than `token_ttl_s` or held on a gone replica; return how many."""
        now = self._clock() if now is None else now
        self._end_holds(now)
        cutoff = now - self.token_ttl_s
        expired = []
        for token_id, grant in self._grants.items():
            if grant.issued_at >= cutoff:
                break
            expired.append(token_id)
        gone = {r for r, left_at in self._left_at.items() if now - left_at >= self.gone_after_s}
        if gone:
            aged = set(expired)
            expired += [t for t, grant in self._grants.items() if grant.replica_id in gone and t not in aged]
            for replica_id in gone:
                del self._left_at[replica_id]
        for token_id in expired:
            self._finish(token_id, self._grants.pop(token_id), _REAPED)
        self.reaped += len(expired)
        if expired:
            self._dispatch()
        return len(expired)

    async def run_reaper(self, interval_s: float = DEFAULT_REAP_INTERVAL_S) -> None:
        """Reap every `interval_s` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            self.reap()

    def in_flight(self, replica_id: str) -> int:
        return self._in_flight.get(replica_id, 0)

    def snapshot(self) -> dict:
        """Per-replica in_flight/capacity (capacity 0: no longer a replica) and the counters."""
        replica_ids = list(self._capacity) + [r for r in self._in_flight if r not in self._capacity]
        return {
            "replicas": {
                r: {"in_flight": self.in_flight(r), "capacity": self._capacity.get(r, 0)} for r in replica_ids
            },
            "outstanding": len(self._grants),
            "token_ttl_s": self.token_ttl_s,
            "waiting": len(self._waiters),
            "granted": self.granted,
            "released": self.released,
            "double_releases": self.double_releases,
            "unknown_releases": self.unknown_releases,
            "late_releases": self.late_releases,
            "reaped": self.reaped,
            "rejected": self.rejected,
            "held_full": sorted(self._held_full),
        }

    def _candidate_set(self, replica_ids: Sequence[str]) -> CandidateSet:
        if replica_ids is self._last_ids and self._last_set is not None:
            return self._last_set
        key = replica_ids if isinstance(replica_ids, tuple) else tuple(replica_ids)
        candidates = self._sets.pop(key, None)
        if candidates is None:
            candidates = CandidateSet(key, {r: self._room(r) for r in self._capacity}, self._in_flight)
        self._sets[key] = candidates
        if len(self._sets) > MAX_CANDIDATE_SETS:
            self._sets.pop(next(iter(self._sets))).alive = False
        # The most recently used set is never the one dropped, so the identity match stays current.
        self._last_ids = replica_ids if isinstance(replica_ids, tuple) else None
        self._last_set = candidates
        return candidates

    def _count(self, replica_id: str, delta: int) -> None:
        """Change a replica's in-flight count and keep the open count and every registered set current."""
        capacity = self._room(replica_id)
        before = self.in_flight(replica_id)
        after = before + delta
        if after or replica_id in self._capacity:
            self._in_flight[replica_id] = after
        else:
            del self._in_flight[replica_id]
        self._open += (after < capacity) - (before < capacity)
        for candidates in self._sets.values():
            candidates.move(replica_id, after, capacity)

    def _room(self, replica_id: str) -> int:  # its capacity, or 0 while it is held full
        return 0 if replica_id in self._held_full else self._capacity.get(replica_id, 0)

    def _set_held(self, replica_id: str, until: float | None) -> None:
        """Hold a replica full until `until`, or end its hold (None); the open count and the sets follow."""
        had_room = self.in_flight(replica_id) < self._room(replica_id)
        if until is None:
            self._held_full.pop(replica_id, None)
        else:
            self._held_full[replica_id] = until
        room = self._room(replica_id)
        self._open += (self.in_flight(replica_id) < room) - had_room
        for candidates in self._sets.values():
            candidates.move(replica_id, self.in_flight(replica_id), room)

    def _end_holds(self, now: float) -> None:
        for replica_id in (ended := [r for r, until in self._held_full.items() if until <= now]):
            self._set_held(replica_id, None)
        if ended:
            self._dispatch()

    def _grant(self, replica_id: str) -> CapacityToken:
        token = CapacityToken(token_id=uuid.uuid4().hex, replica_id=replica_id)
        self._grants[token.token_id] = _Grant(replica_id, self._clock())
        self._count(replica_id, 1)
        self.granted += 1
        return token

    def _finish(self, token_id: str, grant: _Grant, how: str) -> None:
        self._count(grant.replica_id, -1)
        self._finished[token_id] = how
        if len(self._finished) > RELEASED_MEMORY:
            self._finished.popitem(last=False)

    async def _wait(self, candidates: CandidateSet, wait_s: float, request_id: str) -> CapacityToken | None:
        arrival = self._next_waiter
        self._next_waiter += 1
        ticket = self._tickets.setdefault(request_id, arrival)
        if len(self._tickets) > MAX_TICKETS:
            self._tickets.popitem(last=False)  # the oldest: a caller that gave up long ago
        key = (ticket, arrival)
        waiter = _Waiter(candidates, request_id, asyncio.get_running_loop().create_future())
        self._waiters[key] = waiter
        try:
            # shield: a timeout must not cancel the future, which may already hold a token.
            return await asyncio.wait_for(asyncio.shield(waiter.future), wait_s)
        except TimeoutError:
            return waiter.future.result() if waiter.future.done() else None
        except asyncio.CancelledError:
            if waiter.future.done():
                self.release(waiter.future.result().token_id)
            raise
        finally:
            self._waiters.pop(key, None)
            waiter.future.cancel()

    def _dispatch(self) -> None:
        """Hand free slots to waiters, oldest first; stop as soon as no replica has room."""
        served = []
        for key in sorted(self._waiters) if self._open else ():
            waiter = self._waiters[key]
            if not self._open:
                break
            if not waiter.candidates.alive:  # dropped by `set_replicas` or the LRU: register it again
                waiter.candidates = self._candidate_set(waiter.candidates.key)
            replica_id = waiter.candidates.pick(self._rng)
            if replica_id is None:
                continue
            waiter.future.set_result(self._grant(replica_id))
            self._tickets.pop(waiter.request_id, None)
            served.append(key)
        for key in served:
            del self._waiters[key]
