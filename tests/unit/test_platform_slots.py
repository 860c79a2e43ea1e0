"""A platform's model slots and its syncer, without HAProxy: which model takes which slot, which name clash is
refused, and that only differences reach the runtime API."""

from __future__ import annotations

from pathlib import Path

from infra.api_keys import ApiKeySource, key_hash_line
from services.attachments import AttachedModel, AttachedStack
from services.platform.model_slots import assign
from services.platform.syncer import PlatformSyncer
from topologies.platform import Tenant


def _record(stack: str, team: str, port: int, **capacities: int) -> AttachedStack:
    models = [AttachedModel(name=name.replace("_", "-"), capacity=c) for name, c in capacities.items()]
    return AttachedStack(platform="p", stack=stack, team=team, host="127.0.0.1", port=port, models=models)


def test_a_model_keeps_its_slot_while_its_team_frontend_moves_and_a_new_one_takes_the_lowest_free() -> None:
    first = assign(
        {}, [_record("alpha-chat", "alpha", 1000, a_tiny=4), _record("beta-chat", "beta", 2000, b_tiny=4)], 3
    )
    assert {name: entry.slot for name, entry in first.entries.items()} == {"a-tiny": 0, "b-tiny": 1}
    # alpha goes down: its slot frees; beta's redeployed frontend listens elsewhere: same slot, new port.
    second = assign(first.entries, [_record("beta-chat", "beta", 2001, b_tiny=8)], 3)
    assert list(second.entries) == ["b-tiny"] and second.entries["b-tiny"].slot == 1
    assert (second.entries["b-tiny"].port, second.entries["b-tiny"].capacity) == (2001, 8)
    third = assign(second.entries, [_record("beta-chat", "beta", 2001, b_tiny=8), _record("c", "c", 3000, c_tiny=2)], 3)
    assert third.entries["c-tiny"].slot == 0 and not third.refused


def test_a_model_name_another_stack_holds_is_refused_and_a_full_platform_refuses_the_next() -> None:
    held = assign({}, [_record("zeta-chat", "zeta", 1000, tiny=4)], 1).entries
    # A stack sorting first does not take the name from the stack that holds it.
    later = assign(held, [_record("zeta-chat", "zeta", 1000, tiny=4), _record("alpha-chat", "alpha", 2000, tiny=4)], 1)
    assert later.entries["tiny"].stack == "zeta-chat" and later.refused == [("tiny", "alpha-chat")]
    full = assign(held, [_record("zeta-chat", "zeta", 1000, tiny=4), _record("b", "b", 2000, other=4)], 1)
    assert list(full.entries) == ["tiny"] and full.refused == [("other", "b")]


class _Control:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def attach_model(self, slot: int, model: str, host: str, port: int, capacity: int) -> None:
        self.calls.append(("attach", slot, model, port, capacity))

    def detach_model(self, slot: int, model: str) -> None:
        self.calls.append(("detach", slot, model))

    def set_keys(self, keys: dict[str, str]) -> None:
        self.calls.append(("keys", sorted(keys.values())))

    def set_access(self, access: set[tuple[str, str]]) -> None:
        self.calls.append(("access", sorted(access)))


def test_the_syncer_applies_only_differences_and_a_tenant_calls_its_own_teams_models_unless_listed(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "alpha.keys"
    keys.write_text(key_hash_line("sk-alpha") + "\n")
    beta_keys = tmp_path / "beta.keys"
    beta_keys.write_text(key_hash_line("sk-beta") + "\n")
    tenants = [
        Tenant(team="alpha", api_keys=ApiKeySource(file=keys)),
        Tenant(team="beta", api_keys=ApiKeySource(file=beta_keys), models=["a-tiny", "b-tiny"]),
    ]
    records = [_record("alpha-chat", "alpha", 1000, a_tiny=4)]
    control = _Control()
    syncer = PlatformSyncer(control, tenants, lambda: records, slots=4)
    syncer.sync_once()
    assert control.calls == [
        ("attach", 0, "a-tiny", 1000, 4),
        ("access", [("alpha", "a-tiny"), ("beta", "a-tiny")]),
        ("keys", ["alpha", "beta"]),
    ]
    control.calls.clear()
    syncer.sync_once()
    assert control.calls == [], "nothing changed, nothing sent"
    records = [_record("alpha-chat", "alpha", 1001, a_tiny=4), _record("beta-chat", "beta", 2000, b_tiny=4)]
    syncer.sync_once()
    assert control.calls == [
        ("attach", 0, "a-tiny", 1001, 4),
        ("attach", 1, "b-tiny", 2000, 4),
        ("access", [("alpha", "a-tiny"), ("beta", "a-tiny"), ("beta", "b-tiny")]),
    ]
    control.calls.clear()
    records = [_record("beta-chat", "beta", 2000, b_tiny=4)]
    keys.write_text("")  # alpha's keys rotated away
    syncer.sync_once()
    assert control.calls == [("detach", 0, "a-tiny"), ("access", [("beta", "b-tiny")]), ("keys", ["beta"])]
