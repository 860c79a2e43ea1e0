"""The production capacity ledger: one named, detached, restartable Ray actor per deployment.

`CapacityLedgerActor` wraps `routers.capacity_ledger.CapacityLedger` in an async actor; every router of the
deployment finds it by name (`ledger_actor_name`) in the `sluice` namespace. `ActorLedgerClient` is the policy's
`LedgerClient` over it, every call bounded by a timeout; a router's client finds the ledger again once the one it
holds is dead for good (killed with no restart: the next lookup creates it anew). Restart options, constants and why:
routers/README.md#the-ledger-actor.

A ledger found by name takes the caller's `token_ttl_s` (a redeploy's setting applies to the ledger that outlived the
last router), and deleting a stack's apps ends their ledgers (`end_ledgers`): detached, nothing else would.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError

from routers.background import run_in_background
from routers.capacity_ledger import DEFAULT_REAP_INTERVAL_S, DEFAULT_TOKEN_TTL_S, CapacityLedger
from routers.core import CapacityToken

LEDGER_NAMESPACE = "sluice"
LEDGER_NAME_PREFIX = "sluice-capacity-ledger"
# A waiting acquire holds a call slot for up to `WAIT_SLICE_S`; releases must never queue behind waiters.
MAX_CONCURRENCY = 100_000
# On top of a call's own wait: a healthy ledger answers in well under a millisecond plus the RPC.
DEFAULT_CALL_TIMEOUT_S = 1.0


@ray.remote(max_restarts=-1, max_task_retries=0, num_cpus=0, max_concurrency=MAX_CONCURRENCY)
class CapacityLedgerActor:
    def __init__(self, token_ttl_s: float = DEFAULT_TOKEN_TTL_S, reap_interval_s: float = DEFAULT_REAP_INTERVAL_S):
        self._ledger = CapacityLedger(token_ttl_s=token_ttl_s)
        self._reaper = asyncio.get_running_loop().create_task(self._ledger.run_reaper(reap_interval_s))

    async def acquire(self, replica_ids: Sequence[str], request_id: str, wait_s: float = 0.0) -> CapacityToken | None:
        return await self._ledger.acquire(replica_ids, request_id, wait_s)

    async def release(self, token_id: str) -> bool:
        return self._ledger.release(token_id)

    async def reject(self, token_id: str) -> bool:
        return self._ledger.reject(token_id)

    async def set_replicas(self, capacities: dict[str, int]) -> None:
        self._ledger.set_replicas(capacities)

    async def snapshot(self) -> dict:
        return self._ledger.snapshot()

    async def set_token_ttl(self, token_ttl_s: float) -> None:
        self._ledger.token_ttl_s = token_ttl_s


def ledger_actor_name(app: str, deployment: str) -> str:
    return f"{LEDGER_NAME_PREFIX}:{app}:{deployment}"


def get_or_create_ledger(name: str, token_ttl_s: float = DEFAULT_TOKEN_TTL_S) -> ActorHandle:
    """The deployment's ledger actor, created on first use (it outlives the router that made it); one that exists
    takes `token_ttl_s`."""
    handle = CapacityLedgerActor.options(
        name=name, namespace=LEDGER_NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote(token_ttl_s)
    handle.set_token_ttl.remote(token_ttl_s)
    return handle


def end_ledgers(apps: Iterable[str]) -> list[str]:
    """Kill the ledger actors of these apps' deployments for good; returns their names."""
    prefixes = tuple(f"{LEDGER_NAME_PREFIX}:{app}:" for app in apps)
    ended = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == LEDGER_NAMESPACE and actor["name"].startswith(prefixes):
            with contextlib.suppress(ValueError):  # ended meanwhile
                ray.kill(ray.get_actor(actor["name"], namespace=LEDGER_NAMESPACE), no_restart=True)
                ended.append(actor["name"])
    return ended


def actor_ledger_client(app: str, deployment: str, token_ttl_s: float) -> ActorLedgerClient:
    """A client of `deployment`'s ledger actor in `app` (created with `token_ttl_s` on first use) that finds the
    ledger again by name once the one it holds is dead for good."""
    find = functools.partial(get_or_create_ledger, ledger_actor_name(app, deployment), token_ttl_s)
    return ActorLedgerClient(find(), find_again=find)


class ActorLedgerClient:
    """A `LedgerClient` over the ledger actor; every call is bounded by its wait plus `call_timeout_s`. A call to an
    actor dead for good fails as a fault, and the next call goes to the actor `find_again` returns (when given): the
    control store frees a dead actor's name a moment after its death, so a lookup may still return the dead one, and
    calls keep failing (the policy falls back) until the name holds a live ledger."""

    def __init__(
        self,
        handle: ActorHandle,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        find_again: Callable[[], ActorHandle] | None = None,
    ) -> None:
        self.handle = handle
        self.call_timeout_s = call_timeout_s
        self.find_again = find_again
        self._finding = asyncio.Lock()
        self._reclaims: set[asyncio.Task] = set()

    async def acquire(self, replica_ids: Sequence[str], request_id: str, wait_s: float) -> CapacityToken | None:
        handle = self.handle
        ref = handle.acquire.remote(replica_ids, request_id, wait_s)
        try:
            return await asyncio.wait_for(ref, wait_s + self.call_timeout_s)
        except (TimeoutError, asyncio.CancelledError):
            # The wait ends in the ledger too: it leaves the line at once (keeping its ticket, so the request's next
            # ask, e.g. HAProxy's HTTP route call after the route agent's deadline, waits at its place), and
            # a slot granted meanwhile comes back rather than sitting out the slice.
            ray.cancel(ref)
            run_in_background(self._reclaims, self._release_late_grant(ref))
            raise
        except ActorDiedError:
            await self._replace(handle)
            raise

    async def release(self, token_id: str) -> bool:
        return await self._call(lambda handle: handle.release.remote(token_id))

    async def reject(self, token_id: str) -> bool:
        return await self._call(lambda handle: handle.reject.remote(token_id))

    async def set_replicas(self, capacities: dict[str, int]) -> None:
        await self._call(lambda handle: handle.set_replicas.remote(capacities))

    async def snapshot(self) -> dict:
        return await self._call(lambda handle: handle.snapshot.remote())

    async def _call(self, send: Callable[[ActorHandle], Awaitable]) -> Any:
        handle = self.handle
        try:
            return await asyncio.wait_for(send(handle), self.call_timeout_s)
        except ActorDiedError:
            await self._replace(handle)
            raise

    async def _replace(self, dead: ActorHandle) -> None:
        """Look the ledger up again, once for all the calls that found `dead` dead."""
        if self.find_again is None:
            return
        async with self._finding:
            if self.handle is dead:
                # A blocking call to the control store: keep it off the event loop that routes.
                self.handle = await asyncio.to_thread(self.find_again)

    async def _release_late_grant(self, ref: ray.ObjectRef) -> None:
        # An error here means the grant died with the ledger (or the reaper will take it back).
        with contextlib.suppress(Exception):
            token = await ref
            if token is not None:
                await self.release(token.token_id)
