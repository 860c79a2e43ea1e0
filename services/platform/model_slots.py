"""Which attached model holds which of the platform HAProxy's model slots, from the attached stacks' records.

A model keeps its slot while any record names it (its team's frontend moving to new ports changes the slot's
server, not the slot). A name two stacks attach is the first one's: the model already in a slot wins, else the
stack whose name sorts first; the other is listed in `refused` (its `sluice deploy` is refused before it starts,
this only covers a race). A new model takes the lowest free slot; with none free it is refused too. Pure: the
platform's syncer applies the differences (`services/platform/syncer.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.attachments import AttachedStack


@dataclass(frozen=True)
class SlotEntry:
    """What one slot serves: a model, the stack and team that attached it, where its frontend listens."""

    slot: int
    model: str
    stack: str
    team: str
    host: str
    port: int
    capacity: int


@dataclass(frozen=True)
class Assignment:
    entries: dict[str, SlotEntry]
    # (model, stack) of each model that could not take a slot: its name is another stack's, or no slot is free.
    refused: list[tuple[str, str]]


def assign(current: dict[str, SlotEntry], records: list[AttachedStack], slots: int) -> Assignment:
    """The slots after `records` (every attached stack's record), starting from `current`."""
    claims: dict[str, list[tuple[AttachedStack, int]]] = {}
    for record in sorted(records, key=lambda r: r.stack):
        for model in record.models:
            claims.setdefault(model.name, []).append((record, model.capacity))
    refused: list[tuple[str, str]] = []
    owners: dict[str, tuple[AttachedStack, int]] = {}
    for name, claimants in claims.items():
        holder = current.get(name)
        kept = [claim for claim in claimants if holder is not None and claim[0].stack == holder.stack]
        owner = kept[0] if kept else claimants[0]
        owners[name] = owner
        refused += [(name, record.stack) for record, _ in claimants if record.stack != owner[0].stack]
    taken = {current[name].slot for name in owners if name in current}
    free = iter(slot for slot in range(slots) if slot not in taken)
    entries = {}
    for name, (record, capacity) in sorted(owners.items()):
        slot = current[name].slot if name in current else next(free, None)
        if slot is None:
            refused.append((name, record.stack))
            continue
        entries[name] = SlotEntry(slot, name, record.stack, record.team, record.host, record.port, capacity)
    return Assignment(entries, refused)
