"""A platform file and a team file attached to one: what each accepts, what each refuses with its field path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from builders.plan import build_plan
from builders.platform import build_platform_plan
from builders.specs import load_spec
from services.attachments import AttachedModel, AttachedStack
from services.frontend.app import FrontendArgs
from services.platform.app import PlatformArgs
from sluice.deploy.preflight import PreflightError
from topologies.platform import is_platform_file, load_platform
from topologies.problems import SpecError

PLATFORMS = Path(__file__).resolve().parents[2] / "topologies" / "platforms"


def test_the_example_platform_and_its_two_teams_are_valid_and_the_teams_have_no_public_port() -> None:
    platform = load_platform(PLATFORMS / "local-cpu.yaml")
    assert platform.stack == "local-platform" and [t.team for t in platform.tenants] == ["alpha", "beta"]
    assert all(tenant.api_keys.digests() for tenant in platform.tenants)
    for team in ("alpha-chat.yaml", "beta-chat.yaml"):
        spec = load_spec(PLATFORMS / team)
        assert spec.frontend.platform == "local" and spec.frontend.listening_ports() == {}
        assert not is_platform_file(PLATFORMS / team)
    assert is_platform_file(PLATFORMS / "local-cpu.yaml")


def test_an_attached_teams_plan_tells_its_frontend_the_platform_and_each_models_replica_capacity() -> None:
    plan = build_plan(load_spec(PLATFORMS / "alpha-chat.yaml"))
    args = FrontendArgs.model_validate(plan.apps[-1].args)
    assert args.attachment is not None and (args.attachment.platform, args.attachment.team) == ("local", "alpha")
    assert [(app.model, app.max_ongoing_requests) for app in args.attachment.apps] == [("alpha-tiny", 4)]


def test_the_platforms_plan_is_one_frontend_app_with_each_tenants_class_and_limits() -> None:
    plan = build_platform_plan(load_platform(PLATFORMS / "local-cpu.yaml"))
    assert [app.name for app in plan.apps] == ["local-platform-frontend"] and plan.models == []
    args = PlatformArgs.model_validate(plan.apps[0].args)
    routes = {tenant.team: tenant.route for tenant in args.tenants}
    assert routes["alpha"].priority_class == 0 and routes["beta"].priority_class == 1
    assert routes["beta"].requests_per_minute == 600 and args.haproxy["port"] == 8000
    # No tenant with a token quota here: the replica picks no usage port (the platform's HAProxy needs none).
    assert all(route.tokens_per_minute is None for route in routes.values()) and "usage_port" not in args.haproxy


def _team(tmp_path: Path, **frontend: object) -> Path:
    data = yaml.safe_load((PLATFORMS / "alpha-chat.yaml").read_text())
    data["frontend"].update(frontend)
    path = tmp_path / "team.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_an_attached_team_that_asks_for_a_public_side_of_its_own_is_refused_naming_each_field(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as refused:
        load_spec(_team(tmp_path, port=8100, metrics_port=8405))
    assert "frontend" in str(refused.value) and "remove metrics_port, port" in str(refused.value)


def _platform(tmp_path: Path, change: dict) -> Path:
    data = yaml.safe_load((PLATFORMS / "local-cpu.yaml").read_text())
    data.update(change)
    path = tmp_path / "platform.yaml"
    path.write_text(yaml.safe_dump(data))
    (tmp_path / "keys").symlink_to(PLATFORMS / "keys")
    return path


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"tenants": []}, "tenants"),
        ({"name": "Local"}, "name"),
        ({"frontend": {"platform": "other"}}, "a platform's frontend is its own"),
        ({"frontend": {"routers": 2}}, "a platform has no routers"),
        (
            {"tenants": [{"team": "alpha", "api_keys": {"file": "keys/alpha.keys"}, "priority": "urgent"}]},
            "tenants[0].priority",
        ),
        (
            {"tenants": [{"team": "alpha", "api_keys": {"file": "keys/alpha.keys"}, "weight": 0}]},
            "tenants[0].weight",
        ),
        (
            {
                "tenants": [
                    {"team": "alpha", "api_keys": {"file": "keys/alpha.keys"}},
                    {"team": "alpha", "api_keys": {"file": "keys/beta.keys"}},
                ]
            },
            "one tenant per team (alpha",
        ),
    ],
)
def test_a_platform_file_with_a_bad_field_is_refused_naming_it(tmp_path: Path, change: dict, said: str) -> None:
    with pytest.raises(SpecError) as refused:
        load_platform(_platform(tmp_path, change))
    assert said in str(refused.value)


def test_an_attached_team_is_refused_without_its_platform_or_with_a_model_name_another_stack_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sluice.deploy import platforms, registry

    spec = load_spec(PLATFORMS / "alpha-chat.yaml")
    monkeypatch.setattr(registry, "deployed", lambda stack: None)
    with pytest.raises(PreflightError, match="no platform 'local' runs on this cluster"):
        platforms.check_attachment(spec, [])
    record = registry.DeployedStack(stack="local-platform", source="", spec={}, apps=[], deployed_at=0.0)
    monkeypatch.setattr(registry, "deployed", lambda stack: record if stack == "local-platform" else None)
    with pytest.raises(PreflightError, match="no platform 'local'"):
        platforms.check_attachment(spec, ["other-frontend"])
    holder = AttachedStack(
        platform="local",
        stack="gamma-chat",
        team="gamma",
        host="127.0.0.1",
        port=1,
        models=[AttachedModel(name="alpha-tiny", capacity=4)],
    )
    monkeypatch.setattr(platforms.attachments, "attached", lambda platform: [holder])
    with pytest.raises(PreflightError) as refused:
        platforms.check_attachment(spec, ["local-platform-frontend"])
    assert "'alpha-tiny' is already on platform 'local', attached by stack 'gamma-chat' (team gamma)" in str(
        refused.value
    )
    # Its own earlier record (a redeploy) is no clash.
    monkeypatch.setattr(
        platforms.attachments, "attached", lambda platform: [holder.model_copy(update={"stack": "alpha-chat"})]
    )
    platforms.check_attachment(spec, ["local-platform-frontend"])


def test_a_platform_whose_key_file_cannot_be_read_is_not_deployed(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from sluice.cli.main import main

    path = _platform(tmp_path, {"tenants": [{"team": "alpha", "api_keys": {"file": "keys/nowhere.keys"}}]})
    assert main(["deploy", str(path), "--address", "127.0.0.1:1"]) == 1
    assert "cannot read the key file" in capsys.readouterr().err
