"""A stack's ingress from spec to plan to HAProxy: the mode's weight, the legacy ingress app it deploys, the
declared ingress as the frontend's `user_config` (a change reconfigures, never redeploys), and the rendered
canary pieces of the HAProxy config, valid for `haproxy -c`."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from base.contracts import REASON_DUPLICATE_REQUEST
from builders.plan import build_plan, serve_config
from builders.specs import load_spec, parse_spec
from infra.haproxy.apps import AppRoute
from infra.haproxy.canary import LEGACY_BACKEND, RUNNING_TABLE, weights_map
from infra.haproxy.config import HAProxySettings
from infra.haproxy.haproxy_cfg import render_config
from infra.haproxy.lua import render_lua
from infra.haproxy.process import check_config, write_files
from services.frontend.app import build_frontend_application
from topologies.problems import SpecError

TEAMS = Path(__file__).resolve().parents[2] / "topologies" / "teams"


def canary_data(**ingress: object) -> dict:
    data = yaml.safe_load((TEAMS / "canary-cpu.yaml").read_text())
    data["ingress"] = {**data["ingress"], **ingress}
    return data


@pytest.mark.parametrize(("mode", "weight"), [("direct", 100), ("legacy", 0), ("both", 30)])
def test_each_mode_declares_its_direct_weight(mode: str, weight: int) -> None:
    spec = parse_spec(canary_data(mode=mode))
    assert spec.ingress.direct_weight == weight
    assert build_plan(spec).apps[-1].args["ingress"]["direct_weight"] == weight


def test_only_a_stack_that_retains_the_legacy_path_deploys_the_legacy_ingress() -> None:
    both = build_plan(parse_spec(canary_data(mode="both")))
    direct = build_plan(parse_spec(canary_data(mode="direct")))
    assert "platform-canary-cpu-legacy" in [app.name for app in both.apps]
    assert "platform-canary-cpu-legacy" not in [app.name for app in direct.apps]
    legacy = next(app for app in both.apps if app.name == "platform-canary-cpu-legacy")
    assert (
        legacy.args["target_app"] == "platform-canary-cpu-llm" and legacy.route_prefix == "/platform-canary-cpu-legacy"
    )
    # The frontend is the same either way (its legacy backend simply stays empty): a switch never redeploys it.
    strip = lambda plan: {k: v for k, v in plan.apps[-1].args.items() if k != "ingress"}  # noqa: E731
    assert strip(both) == strip(direct)


def test_a_changed_ingress_keeps_the_frontends_version_and_changes_its_user_config() -> None:
    apps = [build_plan(parse_spec(canary_data(canary_weight=w))).apps[-1] for w in (30, 0)]
    deployments = [build_frontend_application(app.args)._bound_deployment for app in apps]
    assert deployments[0].version == deployments[1].version
    assert [d.user_config["direct_weight"] for d in deployments] == [30, 0]


def test_the_rendered_serve_config_declares_the_ingress_as_the_frontends_user_config() -> None:
    config = serve_config(build_plan(load_spec(TEAMS / "canary-cpu.yaml")))
    frontend = config["applications"][-1]
    assert "ingress" not in frontend["args"]
    assert frontend["deployments"] == [
        {"name": "Frontend", "user_config": build_plan(load_spec(TEAMS / "canary-cpu.yaml")).apps[-1].args["ingress"]}
    ]


def test_a_prefill_decode_stack_retains_a_legacy_ingress_relaying_to_decode_and_choosing_prefill() -> None:
    data = yaml.safe_load((TEAMS / "prefill-decode-cpu.yaml").read_text())
    data["ingress"] = {"mode": "both"}
    plan = build_plan(parse_spec(data))
    [model] = plan.models
    assert model.legacy_deployed and model.legacy_app is not None and model.prefill_app is not None
    [legacy] = [app for app in plan.apps if app.name == model.legacy_app]
    assert legacy.args["target_app"] == model.llm_app and legacy.args["prefill_app"] == model.prefill_app
    # Direct only: no legacy app, the decode side's route keeps its legacy prefix unused.
    direct = build_plan(load_spec(TEAMS / "prefill-decode-cpu.yaml"))
    assert not direct.models[0].legacy_deployed and model.legacy_app not in {app.name for app in direct.apps}


@pytest.mark.parametrize("weight", [-1, 101])
def test_a_weight_outside_0_to_100_is_refused(weight: int) -> None:
    with pytest.raises(SpecError):
        parse_spec(canary_data(canary_weight=weight))
    with pytest.raises(ValueError):
        weights_map(["a"], weight)


def test_the_canary_renders_legacy_backends_the_weights_map_and_the_duplicate_refusal(tmp_path: Path) -> None:
    apps = [AppRoute(name="a", model="m-a", legacy_route_prefix="/a-legacy"), AppRoute(name="b", model="m-b")]
    settings = HAProxySettings(workdir=tmp_path, apps=apps, direct_weight=25)
    config, lua = render_config(settings), render_lua(settings)
    assert f"backend {LEGACY_BACKEND}\n" in config and f"backend {LEGACY_BACKEND}_1\n" in config
    assert f"backend {RUNNING_TABLE}" in config and f"hdr x-serve-reason {REASON_DUPLICATE_REQUEST}" in config
    assert f"log unix@{settings.log_socket_path}" in config
    assert str(settings.weights_map_path) in lua and 'legacy_prefix = "/a-legacy"' in lua
    write_files(settings)
    assert settings.weights_map_path.read_text() == "a 25\nb 25\n"
    assert "Configuration file is valid" in check_config(settings)


@pytest.mark.parametrize("command", [["rollback"], ["canary", "--weight", "30"]])
def test_moving_traffic_to_a_stack_without_a_legacy_path_fails_at_once_naming_the_fix(command, capsys) -> None:
    from sluice.cli.main import main

    assert main([*command, str(TEAMS / "local-cpu.yaml"), "--address", "127.0.0.1:1"]) == 1
    error = capsys.readouterr().err
    assert "retains no legacy path" in error and "ingress.mode both" in error
