"""The stack registry around a redeploy (review #11): while it runs the record keeps the spec that ran before with the
new apps added, so `down` deletes whatever the redeploy started; once it succeeded, the apps the new plan no longer
has are the ones to delete (a stack going from one model to two renames every app)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.experimental import internal_kv

from builders.plan import build_plan
from builders.specs import load_spec
from sluice.deploy import registry

TEAMS = Path(__file__).resolve().parents[2] / "topologies" / "teams"


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> dict[str, bytes]:
    """Ray's KV store as a dict."""
    kv: dict[str, bytes] = {}

    def put(key: str, value: str | bytes, overwrite: bool = True) -> None:
        kv[key] = value.encode() if isinstance(value, str) else value

    monkeypatch.setattr(internal_kv, "_internal_kv_put", put)
    monkeypatch.setattr(internal_kv, "_internal_kv_get", lambda key: kv.get(key))
    return kv


def _spec(tmp_path: Path, team_file: str):
    data = yaml.safe_load((TEAMS / team_file).read_text())
    data["name"] = "redeployed"
    path = tmp_path / team_file
    path.write_text(yaml.safe_dump(data))
    spec = load_spec(path)
    return spec, build_plan(spec)


def test_a_redeploy_under_way_keeps_the_running_spec_and_adds_its_apps(store: dict, tmp_path: Path) -> None:
    one_spec, one = _spec(tmp_path, "local-cpu.yaml")
    _, two = _spec(tmp_path, "two-models-cpu.yaml")
    registry.record(one_spec, one, "one.yaml")
    registry.add_apps(two.stack, [app.name for app in two.apps])
    entry = registry.deployed(one.stack)
    assert entry is not None and entry.source == "one.yaml" and entry.spec == one_spec.model_dump(mode="json")
    assert set(entry.apps) == {app.name for app in one.apps} | {app.name for app in two.apps}


def test_the_apps_a_new_plan_no_longer_has_are_retired(store: dict, tmp_path: Path) -> None:
    one_spec, one = _spec(tmp_path, "local-cpu.yaml")
    _, two = _spec(tmp_path, "two-models-cpu.yaml")
    registry.record(one_spec, one, "one.yaml")
    retired = registry.retired_apps(registry.deployed(one.stack), two)
    assert retired and set(retired) == {app.name for app in one.apps} - {app.name for app in two.apps}
    assert f"{one.stack}-llm" in retired
    assert registry.retired_apps(None, two) == [] and registry.retired_apps(registry.deployed(one.stack), one) == []
