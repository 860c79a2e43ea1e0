"""Keeps HAProxy's replica and router slots equal to the live endpoint sets, through the runtime API only.

No reload, no restart: a new replica takes a free `server-template` slot (`set server addr`, `state ready`,
then a map entry replica id -> slot so the Lua action may pin to it); a replica that left is drained (map
entry deleted first so nothing new is pinned to it, slot `state drain` so nothing new is load-balanced to it,
in-flight streams go on) and its slot goes to maintenance and back to the free list only once it holds no
session or after the drain grace. A replaced replica (new id, or same id on a new address) is a new replica.
Everything is keyed by replica id; a slot still draining is never reused. Routers get the same treatment,
without the map (the Lua action reads the UP, non-draining router slots itself).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from infra.haproxy_config import (
    REPLICA_BACKEND,
    ROUTER_BACKEND,
    HAProxySettings,
    replica_slot_names,
    router_slot_names,
)
from infra.runtime_api import RuntimeAPI, ServerStat
from services.serve_internals import ReplicaEndpoint
from sluice.contracts import DEFAULT_DRAIN_GRACE_S

logger = logging.getLogger(__name__)

EndpointSource = Callable[[], Awaitable[list[ReplicaEndpoint]]]


@dataclass
class Slot:
    name: str
    endpoint: ReplicaEndpoint | None = None
    draining_since: float | None = None
    # When the slot was last freed: the least recently freed free slot is reused first.
    freed_at: float = float("-inf")

    @property
    def free(self) -> bool:
        return self.endpoint is None and self.draining_since is None


@dataclass
class SyncReport:
    added: list[tuple[str, str]] = field(default_factory=list)  # (replica id, slot)
    drained: list[tuple[str, str]] = field(default_factory=list)
    freed: list[str] = field(default_factory=list)
    no_slot: list[str] = field(default_factory=list)  # replica ids left out: every slot taken

    @property
    def changed(self) -> bool:
        return bool(self.added or self.drained or self.freed)


class SlotPool:
    """The slots of one backend and which replica id holds which."""

    def __init__(self, backend: str, slot_names: list[str], map_path: Path | None) -> None:
        self.backend = backend
        self.map_path = map_path
        self.slots = {name: Slot(name) for name in slot_names}

    @property
    def active(self) -> dict[str, str]:
        """Replica id -> slot name of every slot that holds a replica (a fresh dict on every read)."""
        return {s.endpoint.replica_id: s.name for s in self.slots.values() if s.endpoint is not None}

    def slot_of(self, replica_id: str) -> str | None:
        return self.active.get(replica_id)

    def draining(self) -> list[str]:
        return [s.name for s in self.slots.values() if s.draining_since is not None]

    def take_free_slot(self) -> Slot | None:
        free = [s for s in self.slots.values() if s.free]
        return min(free, key=lambda s: s.freed_at) if free else None


def _same_address(a: ReplicaEndpoint, b: ReplicaEndpoint) -> bool:
    return (a.host, a.port) == (b.host, b.port)


class HAProxySyncer:
    """Reconciles HAProxy's slots with `replica_source()` and `router_source()` (e.g. `list_replica_endpoints`)."""

    def __init__(
        self,
        runtime: RuntimeAPI,
        settings: HAProxySettings,
        replica_source: EndpointSource,
        router_source: EndpointSource,
        drain_grace_s: float = DEFAULT_DRAIN_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runtime = runtime
        self.replica_source = replica_source
        self.router_source = router_source
        self.drain_grace_s = drain_grace_s
        self.clock = clock
        self.replicas = SlotPool(REPLICA_BACKEND, replica_slot_names(settings), settings.map_path)
        self.routers = SlotPool(ROUTER_BACKEND, router_slot_names(settings), None)
        self._adopted = False

    async def sync_once(self) -> SyncReport:
        """One reconciliation pass. A source that fails leaves HAProxy as it is (the error propagates)."""
        replicas = await self.replica_source()
        routers = await self.router_source()
        return await asyncio.to_thread(self._sync, replicas, routers)

    async def run(self, interval_s: float = 0.25) -> None:
        """Reconcile every `interval_s` until cancelled; a failed pass is logged and retried."""
        while True:
            try:
                report = await self.sync_once()
                # A replica left out for want of a slot is logged (a warning) where it happens.
                if report.changed:
                    logger.info("haproxy sync: %s", report)
            except Exception:
                logger.exception("haproxy sync pass failed; retrying in %.2f s", interval_s)
            await asyncio.sleep(interval_s)

    # Blocking part (runs in a worker thread; the runtime API is a unix socket round trip per command).
    def _sync(self, replicas: list[ReplicaEndpoint], routers: list[ReplicaEndpoint]) -> SyncReport:
        stats = self.runtime.show_stat()
        if not self._adopted:
            self._adopt(stats, routers)
            self._adopted = True
        report = SyncReport()
        for pool, endpoints in ((self.replicas, replicas), (self.routers, routers)):
            self._sync_pool(pool, endpoints, stats, report)
        return report

    def _sync_pool(
        self,
        pool: SlotPool,
        endpoints: list[ReplicaEndpoint],
        stats: dict[tuple[str, str], ServerStat],
        report: SyncReport,
    ) -> None:
        wanted = {e.replica_id: e for e in endpoints}
        now = self.clock()
        # 1. Replicas that left (or moved to a new address): stop pinning, then drain.
        for replica_id, slot_name in sorted(pool.active.items()):
            slot = pool.slots[slot_name]
            live = wanted.get(replica_id)
            if live is not None and slot.endpoint is not None and _same_address(live, slot.endpoint):
                continue
            if pool.map_path is not None:
                self.runtime.del_map(pool.map_path, replica_id)
            self.runtime.set_server_state(pool.backend, slot_name, "drain")
            slot.endpoint = None
            slot.draining_since = now
            report.drained.append((replica_id, slot_name))
        # 2. Draining slots with no session left (or past the grace): maintenance, then free.
        for slot in pool.slots.values():
            if slot.draining_since is None:
                continue
            stat = stats.get((pool.backend, slot.name))
            idle = stat is not None and stat.scur == 0 and not _drained_this_pass(slot, now)
            if idle or now - slot.draining_since >= self.drain_grace_s:
                self.runtime.set_server_state(pool.backend, slot.name, "maint")
                slot.draining_since = None
                slot.freed_at = now
                report.freed.append(slot.name)
        # 3. New replicas: a free slot each.
        active = pool.active
        for replica_id, endpoint in sorted(wanted.items()):
            if replica_id in active:
                continue
            slot = pool.take_free_slot()
            if slot is None:
                report.no_slot.append(replica_id)
                logger.warning(
                    "no free %s slot for %s (all %d taken or draining)", pool.backend, replica_id, len(pool.slots)
                )
                continue
            self.runtime.set_server_addr(pool.backend, slot.name, endpoint.host, endpoint.port)
            self.runtime.set_server_state(pool.backend, slot.name, "ready")
            if pool.map_path is not None:
                self.runtime.add_map(pool.map_path, replica_id, slot.name)
            slot.endpoint = endpoint
            report.added.append((replica_id, slot.name))

    def _adopt(self, stats: dict[tuple[str, str], ServerStat], routers: list[ReplicaEndpoint]) -> None:
        """Take over what an earlier syncer left in this HAProxy: slots not in maintenance are kept when the
        map (replicas) or the address (routers) says whose they are, and drained otherwise."""
        now = self.clock()
        replica_map = self.runtime.show_map(self.replicas.map_path) if self.replicas.map_path else {}
        router_by_addr = {f"{e.host}:{e.port}": e for e in routers}
        for pool in (self.replicas, self.routers):
            owners = {slot: rid for rid, slot in replica_map.items()} if pool is self.replicas else {}
            for slot in pool.slots.values():
                stat = stats.get((pool.backend, slot.name))
                if stat is None or stat.admin_maint:
                    continue
                host, _, port = stat.addr.rpartition(":")
                if pool is self.replicas and slot.name in owners and not stat.draining:
                    endpoint = ReplicaEndpoint(replica_id=owners[slot.name], deployment="", host=host, port=int(port))
                elif pool is self.routers and stat.addr in router_by_addr and not stat.draining:
                    endpoint = router_by_addr[stat.addr]
                else:
                    slot.draining_since = now
                    continue
                slot.endpoint = endpoint
        # Map entries that point at no adopted slot would pin to a slot that is not theirs: drop them.
        adopted = self.replicas.active
        for replica_id, slot_name in replica_map.items():
            if adopted.get(replica_id) != slot_name:
                self.runtime.del_map(self.replicas.map_path, replica_id)
        if any(pool.active or pool.draining() for pool in (self.replicas, self.routers)):
            logger.info("adopted HAProxy state: replicas %s, routers %s", self.replicas.active, self.routers.active)


def _drained_this_pass(slot: Slot, now: float) -> bool:
    # `stats` was read before this pass set the slot to drain: its scur may predate a request pinned a moment
    # before the map entry went away. Free a slot at the earliest on the pass after the one that drained it.
    return slot.draining_since == now
