"""ConsistentHash: a ring of virtual nodes; a session keeps its replica while the replica set is stable.

The key (session id, else request id; with `user_affinity` the body's `user`) hashes to the first ring point
clockwise; the fallbacks are the next `num_fallback_replicas` distinct owners. Opt-in bounded load (`load_factor`)
lets a hot replica's sessions spill over. Algorithm, complexity, constants and why: routers/README.md#consistent_hash.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator, Sequence
from itertools import islice

import mmh3
from pydantic import Field

from base.contracts import TABLE_RING
from routers.core import DEFAULT_NUM_FALLBACK_REPLICAS, InFlightTracker, ReplicaView, RouteRequest, RoutingPolicy
from routers.entry import PolicyContext, PolicyEntry, PolicySettings

NAME = "consistent_hash"

# Fixed, with equal hashes ordered by replica id: every router replica builds the same ring from the same set.
HASH_SEED = 0xF9B4CA77
# Keeps each replica's share of the ring even (coefficient of variation about 0.1).
VIRTUAL_NODES = 100
# Up to this many replicas joining or leaving at once, moving points in place beats re-sorting the whole ring.
_MAX_IN_PLACE_CHANGES = 8


class ConsistentHashSettings(PolicySettings):
    num_fallback_replicas: int = Field(DEFAULT_NUM_FALLBACK_REPLICAS, ge=0)
    load_factor: float | None = Field(None, ge=1.0)
    user_affinity: bool = False


def _hash(key: str) -> int:
    return mmh3.hash64(key, seed=HASH_SEED, signed=False)[0]


def _vnode_hashes(replica_id: str) -> list[int]:
    return [_hash(f"{replica_id}:{i}") for i in range(VIRTUAL_NODES)]


class ConsistentHash(RoutingPolicy):
    name = NAME
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


def _build(settings: ConsistentHashSettings, context: PolicyContext) -> ConsistentHash:
    return ConsistentHash(
        num_fallback_replicas=settings.num_fallback_replicas,
        load_factor=settings.load_factor,
        user_affinity=settings.user_affinity,
    )


def _body_use(settings: ConsistentHashSettings) -> tuple[str, str] | None:
    return ("user_affinity", "user_affinity reads the body's `user`") if settings.user_affinity else None


def _table(settings: ConsistentHashSettings) -> tuple[str, int] | None:
    """A ring the frontend can walk itself: not with bounded load (each decision reads live load) nor user affinity
    (the key is in the body)."""
    if settings.load_factor is not None or settings.user_affinity:
        return None
    return TABLE_RING, settings.num_fallback_replicas


ENTRY = PolicyEntry(NAME, ConsistentHashSettings, _build, body_use=_body_use, table=_table)
