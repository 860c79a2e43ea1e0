"""One membership truth: a router ranks only the replicas the asking frontend can route to.

Serve's replica list is the candidate set; a frontend that published (`Membership`) gets the views in its latest
set, an unnamed or silent one the views every publishing frontend can route to, and with no publication at all
every view. The result may be empty (the policy refuses with `no_replica`). A view whose replica the publications
count open requests for carries their sum over the frontends (`in_flight_sampled`). A frontend silent for
`PUBLICATION_TTL_S` (three heartbeats) is forgotten: its set no longer narrows the common one, its counts no longer
load a replica. The rule and why: services/router/README.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from base.contracts import PUBLICATION_TTL_S
from base.route_wire import Membership, replica_of
from routers.core import ReplicaView


class FrontendMembership:
    """The latest publication per frontend and the views each frontend may be offered.

    The filtered views are cached per publishing frontend (plus one entry for everyone else), keyed by the
    identity of the views sequence: a route call pays O(N) only after the views or a publication changed.
    Callers must replace the views sequence rather than mutate it (`LiveReplicas` builds a new tuple)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._sets: dict[str, frozenset[str]] = {}
        # Per frontend: when its last publication (a heartbeat too) arrived.
        self._heard: dict[str, float] = {}
        # Per frontend: its open requests per replica; and their sum over the frontends.
        self._in_flight: dict[str, dict[str, int]] = {}
        self._in_flight_sum: dict[str, int] = {}
        # The ids every publishing frontend can route to; None while nothing was published.
        self._common: frozenset[str] | None = None
        # Key: a publishing frontend, or None for the common set. Value: (views seen, views filtered).
        self._cache: dict[str | None, tuple[Sequence[ReplicaView], tuple[ReplicaView, ...]]] = {}

    def publish(self, membership: Membership) -> bool:
        """Replace `membership.frontend`'s set and open requests; an unchanged publication (a heartbeat) keeps the
        cache. Returns whether it is a new sample of open requests: counts that changed, or any open request (counted
        again at this pass, however equal the counts: the requests behind them may be new)."""
        ids = frozenset(membership.replica_ids)
        frontend = membership.frontend
        self._heard[frontend] = self._clock()
        self._forget_silent()
        changed = self._in_flight.get(frontend) != membership.in_flight
        new_sample = changed or any(membership.in_flight.values())
        if self._sets.get(frontend) == ids and not changed:
            return new_sample
        self._sets[frontend] = ids
        self._in_flight[frontend] = membership.in_flight
        self._recompute()
        return new_sample

    def _forget_silent(self) -> None:
        """Drop the frontends that published nothing for `PUBLICATION_TTL_S`: gone, or cut off from this router."""
        now = self._clock()
        silent = [frontend for frontend, heard in self._heard.items() if now - heard > PUBLICATION_TTL_S]
        for frontend in silent:
            del self._heard[frontend]
            self._sets.pop(frontend, None)
            self._in_flight.pop(frontend, None)
        if silent:
            self._recompute()

    def _recompute(self) -> None:
        self._common = frozenset.intersection(*self._sets.values()) if self._sets else None
        self._in_flight_sum = {}
        for counts in self._in_flight.values():
            for replica_id, count in counts.items():
                self._in_flight_sum[replica_id] = self._in_flight_sum.get(replica_id, 0) + count
        self._cache.clear()

    def routable(self, views: Sequence[ReplicaView], frontend: str | None) -> Sequence[ReplicaView]:
        """The views `frontend` (None: unnamed) may be offered, by the rule of the module docstring."""
        self._forget_silent()
        if self._common is None:
            return views
        # Unknown names share the common entry, so the cache stays bounded by the publishing frontends.
        key = frontend if frontend in self._sets else None
        cached = self._cache.get(key)
        if cached is not None and cached[0] is views:
            return cached[1]
        allowed = self._common if key is None else self._sets[key]
        filtered = tuple(self._sampled(view) for view in views if replica_of(view.replica_id) in allowed)
        self._cache[key] = (views, filtered)
        return filtered

    def _sampled(self, view: ReplicaView) -> ReplicaView:
        """The view with its replica's open requests, when published (an engine rank's view of a data-parallel
        replica has none of its own: HAProxy counts the replica's)."""
        count = self._in_flight_sum.get(view.replica_id)
        return view if count is None else replace(view, in_flight=count, in_flight_sampled=True)
