"""Consistent hashing on a ring of virtual nodes: a session keeps its replica while the set is stable.

Algorithm. Every routable replica owns `VIRTUAL_NODES` points on a 64-bit ring, the murmur3 hashes of
`f"{replica_id}:{i}"`; points are sorted by (hash, replica_id). A request's key is its session id, or
its request id when it has none; with `user_affinity` (opt-in, for apps that forward bodies) a request
without a session id is keyed by the body's OpenAI `user` field when the body has one, so an end user
sticks to a replica without a custom header. The primary is the owner of the first point clockwise of the key's
hash (wrapping at the end); the fallbacks are the next `num_fallback_replicas` (default
`DEFAULT_NUM_FALLBACK_REPLICAS` = 2, from `routers.core`) *distinct* owners met walking on
clockwise, so a replica that rejects the request sends it somewhere else. Adding a replica
moves only the keys its new points take over (about 1/(N+1) of them, all to the new replica);
removing one moves only the keys it owned.

Bounded load (opt-in, `load_factor` c >= 1): with `total` = live in-flight over the routable replicas
plus this request, a replica is eligible while `in_flight + 1 <= ceil(c * total / N)`; the primary is
the first eligible owner clockwise of the hash (reason `bound_exceeded` when that is not the natural
owner) and the fallbacks are the distinct owners after it, whatever their load. The bounds add up to
at least `total`, so some replica is always eligible. The live in-flight sum is kept, not added up per
decision: it is summed once per views snapshot (O(N)) and then follows each change of the tracker's
counts (`InFlightTracker.on_count_changed`, O(1)); eligibility is checked only for the owners the walk
meets, so a bounded decision costs what an unbounded one does plus one check per owner passed over.

Complexity. A lookup is a bisect over N*100 points, O(log(N*100)), plus a short clockwise walk to
collect distinct owners (a few points on average). The ring changes only when the routable replica
set does. Each replica's 100 hashes are cached, so a change hashes only the new replicas; a change
of a few replicas is applied in place (a bisect and a list insert or delete per point, O(N*100)
memory moves each), a larger one re-sorts all N*100 points, O(N*100 log(N*100)).

Constants, and why. `HASH_SEED` and `VIRTUAL_NODES` are fixed, and equal hashes are ordered by replica
id, so every router replica builds the identical ring from the same set and routes a session to the
same place without talking to the others; the ring depends only on the set, not on the order in which
replicas came and went. 100 virtual nodes keep the per-replica share even (coefficient of variation
about 0.1). The policy ignores queue depth by design: a hot session stays on its primary, keeping its
prefix cache warm, unless the primary rejects it; bounded load is the opt-in that lets it spill over.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator, Sequence
from itertools import islice

import mmh3

from routers.core import DEFAULT_NUM_FALLBACK_REPLICAS, InFlightTracker, ReplicaView, RouteRequest, RoutingPolicy

HASH_SEED = 0xF9B4CA77
VIRTUAL_NODES = 100
# Up to this many replicas joining or leaving at once, moving points in place beats re-sorting the whole ring.
_MAX_IN_PLACE_CHANGES = 8


def _hash(key: str) -> int:
    return mmh3.hash64(key, seed=HASH_SEED, signed=False)[0]


def _vnode_hashes(replica_id: str) -> list[int]:
    return [_hash(f"{replica_id}:{i}") for i in range(VIRTUAL_NODES)]


class ConsistentHash(RoutingPolicy):
    name = "consistent_hash"
    sticky = True

    def __init__(
        self,
        num_fallback_replicas: int = DEFAULT_NUM_FALLBACK_REPLICAS,
        load_factor: float | None = None,
        user_affinity: bool = False,
    ):
        if num_fallback_replicas < 0:
            raise ValueError(f"num_fallback_replicas must be >= 0, got {num_fallback_replicas}")
        if load_factor is not None and not load_factor >= 1.0:
            raise ValueError(f"load_factor must be None (unbounded) or >= 1.0, got {load_factor}")
        super().__init__()
        self.num_fallback_replicas = num_fallback_replicas
        self.load_factor = load_factor
        self.user_affinity = user_affinity
        self.rebuild_count = 0
        self._vnodes: dict[str, list[int]] = {}
        # The ring as parallel lists sorted by (hash, owner): bisect works on the plain ints.
        self._points: list[int] = []
        self._owners: list[str] = []
        # Bounded load: the live in-flight sum over these views, kept current through this tracker's changes.
        self._load_views: dict[str, ReplicaView] = {}
        self._load_tracker: InFlightTracker | None = None
        self._load_total = 0

    def on_replicas_changed(self, replica_ids: Sequence[str]) -> None:
        current = set(replica_ids)
        removed = self._vnodes.keys() - current
        added = sorted(current - self._vnodes.keys())
        in_place = len(removed) + len(added) <= _MAX_IN_PLACE_CHANGES
        for replica_id in removed:
            hashes = self._vnodes.pop(replica_id)
            if in_place:
                for h in hashes:
                    i = self._position(h, replica_id)
                    del self._points[i], self._owners[i]
        for replica_id in added:
            self._vnodes[replica_id] = hashes = _vnode_hashes(replica_id)
            if in_place:
                for h in hashes:
                    i = self._position(h, replica_id)
                    self._points.insert(i, h)
                    self._owners.insert(i, replica_id)
        if not in_place:
            ids = sorted(self._vnodes)
            points = [h for replica_id in ids for h in self._vnodes[replica_id]]
            owners = [replica_id for replica_id in ids for _ in range(VIRTUAL_NODES)]
            # The sort is stable over id-ordered input, so equal hashes stay ordered by replica id.
            order = sorted(range(len(points)), key=points.__getitem__)
            self._points = [points[i] for i in order]
            self._owners = [owners[i] for i in order]
        self.rebuild_count += 1

    def lookup(self, key: str, eligible: Callable[[str], bool] | None = None) -> tuple[list[str], bool]:
        """The primary and its fallbacks for `key`, and whether the natural owner was passed over.

        With `eligible`, the primary is the first owner clockwise that it accepts; fallbacks may be any."""
        start = bisect_right(self._points, _hash(key)) % len(self._points)
        walk = self._walk(start)
        natural_pos, primary = next(walk)
        pos = natural_pos
        if eligible is not None and not eligible(primary):
            pos, primary = next((p, owner) for p, owner in walk if eligible(owner))
        after = (owner for _, owner in self._walk((pos + 1) % len(self._points)) if owner != primary)
        return [primary, *islice(after, self.num_fallback_replicas)], pos != natural_pos

    def _rank(self, replicas: list[ReplicaView], request: RouteRequest) -> tuple[list[list[ReplicaView]], str]:
        views = self.views_by_id
        eligible = None
        if self.load_factor is not None:
            bound = math.ceil(self.load_factor * (self._live_total() + 1) / len(views))

            def eligible(replica_id: str) -> bool:
                view = views.get(replica_id)
                return view is not None and self.live_in_flight(view) + 1 <= bound

        key, sticky_reason = self._key(request)
        ids, passed_over = self.lookup(key, eligible)
        reason = "bound_exceeded" if passed_over else sticky_reason
        return [[views[replica_id]] for replica_id in ids], reason

    def _live_total(self) -> int:
        """Live in-flight summed over the routable replicas: O(N) for new views or a new tracker, else O(1)."""
        if self.views_by_id is not self._load_views or self.tracker is not self._load_tracker:
            if self._load_tracker is not None and self._load_tracker.on_count_changed == self._count_changed:
                self._load_tracker.on_count_changed = None
            self._load_views, self._load_tracker = self.views_by_id, self.tracker
            self.tracker.on_count_changed = self._count_changed
            self._load_total = sum(self.live_in_flight(view) for view in self.views_by_id.values())
        return self._load_total

    def _count_changed(self, replica_id: str, old: int, new: int) -> None:
        view = self._load_views.get(replica_id)
        if view is not None:
            self._load_total += max(view.in_flight, new) - max(view.in_flight, old)

    def _key(self, request: RouteRequest) -> tuple[str, str]:
        """The hash key and the decision reason it gives when the primary is the natural owner."""
        if request.session_id:
            return request.session_id, "primary"
        if self.user_affinity and request.user:
            # Prefixed so a user id never lands where the same string as a session id would.
            return f"user:{request.user}", "user_affinity"
        return request.request_id, "no_session_header"

    def _position(self, h: int, replica_id: str) -> int:
        """Where point (h, replica_id) sits, or would be inserted, in the (hash, owner) order."""
        lo = bisect_left(self._points, h)
        return bisect_left(self._owners, replica_id, lo, bisect_right(self._points, h, lo))

    def _walk(self, start: int) -> Iterator[tuple[int, str]]:
        """Each distinct owner clockwise from ring index `start`, with the index where it first appears."""
        owners, size = self._owners, len(self._owners)
        seen: set[str] = set()
        for step in range(size):
            pos = (start + step) % size
            if owners[pos] not in seen:
                seen.add(owners[pos])
                yield pos, owners[pos]
                if len(seen) == len(self._vnodes):
                    return
