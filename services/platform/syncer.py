"""Keeps a platform's HAProxy equal to what is attached: each attached model in a slot of its own (its team
frontend's address and capacity), each tenant's keys, and which tenant may call which model; all through the runtime
API, never a reload.

Every `SYNC_INTERVAL_S` it reads the attached stacks' records (`services.attachments`), assigns slots
(`services.platform.model_slots`) and applies only the differences: a new or moved model is attached (its slot's
server pointed at the team's frontend, its `maxconn` the model's capacity), a model no record names any more is
detached (new requests get 404 at once; streams in flight finish). A model whose capacity is 0 (no replica live)
stays attached with a capacity of 1: its team's frontend answers why it cannot serve (503 with its reason). Keys are
read from each tenant's source every sync (a rotated key file needs no redeploy).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from infra.api_keys import ApiKeyError, ApiKeySource
from services.attachments import AttachedStack
from services.platform.model_slots import SlotEntry, assign

logger = logging.getLogger(__name__)

# How often the platform looks at the attached stacks' records (a team's deploy waits for its models to appear).
SYNC_INTERVAL_S = 0.5


class PlatformControl(Protocol):
    """What the syncer changes in the platform's HAProxy at run time."""

    def attach_model(self, slot: int, model: str, host: str, port: int, capacity: int) -> None: ...

    def detach_model(self, slot: int, model: str) -> None: ...

    def set_keys(self, keys: dict[str, str]) -> None: ...

    def set_access(self, access: set[tuple[str, str]]) -> None: ...


class TenantAccess(Protocol):
    """A tenant as the syncer needs it: its team, its keys' source and the models its keys may call."""

    @property
    def team(self) -> str: ...

    @property
    def api_keys(self) -> ApiKeySource: ...

    def may_call(self, model: str, owner_team: str) -> bool: ...


def tenant_keys(tenants: list[TenantAccess]) -> dict[str, str]:
    """Key digest -> tenant, over every tenant's source; a source that cannot be read keeps no key (logged)."""
    keys: dict[str, str] = {}
    for tenant in tenants:
        try:
            digests = tenant.api_keys.digests()
        except ApiKeyError as error:
            logger.error("tenant %s: %s; its keys are refused until it can be read", tenant.team, error)
            continue
        for digest in digests:
            if keys.setdefault(digest, tenant.team) != tenant.team:
                logger.error(
                    "a key of tenant %s is also tenant %s's: it stays %s's", tenant.team, keys[digest], keys[digest]
                )
    return keys


def tenant_access(tenants: list[TenantAccess], entries: dict[str, SlotEntry]) -> set[tuple[str, str]]:
    return {
        (tenant.team, model)
        for tenant in tenants
        for model, entry in entries.items()
        if tenant.may_call(model, entry.team)
    }


class PlatformSyncer:
    def __init__(
        self,
        control: PlatformControl,
        tenants: list[TenantAccess],
        records: Callable[[], list[AttachedStack]],
        slots: int,
    ) -> None:
        self._control = control
        self._tenants = tenants
        self._records = records
        self._slots = slots
        self.entries: dict[str, SlotEntry] = {}
        self.refused: list[tuple[str, str]] = []
        self._keys: dict[str, str] | None = None
        # (tenant, model) pairs HAProxy lets through, as last set.
        self.access: set[tuple[str, str]] = set()
        self._access_set = False

    def sync_once(self) -> None:
        assignment = assign(self.entries, self._records(), self._slots)
        for name, entry in self.entries.items():
            if name not in assignment.entries:
                self._control.detach_model(entry.slot, name)
        for name, entry in assignment.entries.items():
            if self.entries.get(name) != entry:
                # No replica live: one request at a time reaches the team's frontend, which says why it cannot serve.
                self._control.attach_model(entry.slot, name, entry.host, entry.port, max(entry.capacity, 1))
        if assignment.refused != self.refused and assignment.refused:
            logger.error("models not attached (a name another stack holds, or no slot free): %s", assignment.refused)
        self.entries, self.refused = assignment.entries, assignment.refused
        access = tenant_access(self._tenants, self.entries)
        if access != self.access or not self._access_set:
            self._control.set_access(access)
            self.access, self._access_set = access, True
        keys = tenant_keys(self._tenants)
        if keys != self._keys:
            self._control.set_keys(keys)
            self._keys = keys

    async def run(self) -> None:
        """Sync every `SYNC_INTERVAL_S` until cancelled; a failed pass is logged and tried again at the next."""
        while True:
            try:
                await asyncio.to_thread(self.sync_once)
            except Exception:
                logger.exception("platform sync pass failed; retrying in %.2f s", SYNC_INTERVAL_S)
            await asyncio.sleep(SYNC_INTERVAL_S)
