"""The preflight's verdicts and messages, without a cluster: each problem names its exact fix."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from base.runtime import (
    COMPATIBLE_RAY_START,
    CPU_ENGINE_ENV,
    HF_OFFLINE_ENV,
    SERVE_CONTROLLER_ENV_KEYS,
    carried_env,
    process_env,
)
from builders.plan import build_plan
from builders.specs import load_spec
from services.serve_internals import ControllerSettings
from sluice.cli.main import main
from sluice.deploy import preflight
from sluice.deploy.preflight import PREFLIGHT_EXIT_CODE, PreflightError

TEAMS = Path(__file__).resolve().parents[2] / "topologies" / "teams"


def _controller(monkeypatch: pytest.MonkeyPatch, **settings: Any) -> None:
    view = {"direct_ingress": True, "env": {}, "http_host": "127.0.0.1", "applications": ["team-app"], **settings}
    monkeypatch.setattr(
        "services.serve_internals.serve_controller_settings", lambda keys, timeout_s: ControllerSettings(**view)
    )


def test_no_cluster_exits_3_within_10_s_with_the_ray_start_line(capsys: pytest.CaptureFixture[str]) -> None:
    began = time.monotonic()
    assert main(["deploy", str(TEAMS / "local-cpu.yaml"), "--address", "127.0.0.1:1"]) == PREFLIGHT_EXIT_CODE
    assert time.monotonic() - began < 10
    error = capsys.readouterr().err
    assert "no Ray cluster at '127.0.0.1:1'" in error and COMPATIBLE_RAY_START in error


def test_a_serve_without_direct_ingress_is_refused_with_both_fixes(monkeypatch: pytest.MonkeyPatch) -> None:
    _controller(monkeypatch, direct_ingress=False)
    with pytest.raises(PreflightError) as refused:
        preflight.check_serve_controller(must_reach_nodes=False)
    assert "RAY_SERVE_ENABLE_DIRECT_INGRESS=1" in refused.value.problem
    # Either restart Serve (naming what that deletes) or restart Ray with every setting in its environment.
    assert "serve shutdown -y" in refused.value.fix and "team-app" in refused.value.fix
    assert preflight.ray_start_line() in refused.value.fix
    assert all(f"{key}={process_env()[key]}" in refused.value.fix for key in SERVE_CONTROLLER_ENV_KEYS)


def test_rays_own_haproxy_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _controller(monkeypatch, env={"RAY_SERVE_ENABLE_HA_PROXY": "1"})
    with pytest.raises(PreflightError, match="RAY_SERVE_ENABLE_HA_PROXY=1"):
        preflight.check_serve_controller(must_reach_nodes=False)


def test_serve_on_loopback_cannot_serve_nodes_on_other_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    _controller(monkeypatch)
    assert preflight.check_serve_controller(must_reach_nodes=False)
    with pytest.raises(PreflightError, match="not on loopback"):
        preflight.check_serve_controller(must_reach_nodes=True)


def test_no_controller_means_sluice_starts_serve_with_its_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("services.serve_internals.serve_controller_settings", lambda keys, timeout_s: None)
    assert not preflight.check_serve_controller(must_reach_nodes=False)
    _addresses(monkeypatch, "127.0.0.1")
    options = preflight.serve_start_options(spans_nodes=False)
    assert options["http_options"]["host"] == "127.0.0.1"
    env = options["controller_options"]["runtime_env"]["env_vars"]
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1" and env["RAY_SERVE_ENABLE_HA_PROXY"] == "0"


def _addresses(monkeypatch: pytest.MonkeyPatch, *addresses: str) -> None:
    nodes = [{"Alive": True, "NodeManagerAddress": address} for address in addresses]
    monkeypatch.setattr(preflight, "_alive_nodes", lambda: nodes)


def test_serve_binds_a_single_nodes_own_address_never_a_wildcard(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain `ray start --head` on a host's address (review #10): Serve's proxy and every replica's own port bind
    that address; only several nodes, which Serve gives one host for all, bind every interface."""
    _addresses(monkeypatch, "10.1.2.3")
    assert preflight.serve_http_host(spans_nodes=False) == "10.1.2.3"
    _addresses(monkeypatch, "10.1.2.3", "10.1.2.4")
    assert preflight.serve_http_host(spans_nodes=False) == "0.0.0.0"
    _addresses(monkeypatch, "10.1.2.3")
    assert preflight.serve_http_host(spans_nodes=True) == "0.0.0.0"


def test_the_apps_carry_every_worker_setting_but_the_node_start_and_engine_ones() -> None:
    carried = carried_env()
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in carried
    assert carried["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1" and carried["HF_HOME"].endswith("/hf")
    # Each LLM replica adds its engine's (`engine_env`): a GPU engine or a Hub model must not inherit CPU or offline.
    assert not carried.keys() & (CPU_ENGINE_ENV.keys() | HF_OFFLINE_ENV.keys())


def _nodes(monkeypatch: pytest.MonkeyPatch, *resources: dict[str, float]) -> None:
    import ray

    total: dict[str, float] = {}
    for node in resources:
        for key, value in node.items():
            total[key] = total.get(key, 0.0) + value
    monkeypatch.setattr(preflight, "_alive_nodes", lambda: [{"Resources": r, "Alive": True} for r in resources])
    monkeypatch.setattr(ray, "cluster_resources", lambda: total)


def test_resources_the_plan_asks_for_must_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = build_plan(load_spec(TEAMS / "local-cpu.yaml"))  # 2 replicas x 0.25 CPU
    _nodes(monkeypatch, {"CPU": 2.0})
    preflight.check_resources(plan)
    _nodes(monkeypatch, {"CPU": 0.1}, {"CPU": 0.1})
    with pytest.raises(PreflightError, match="no node of the cluster can hold one replica"):
        preflight.check_resources(plan)
    _nodes(monkeypatch, {"CPU": 0.25})
    with pytest.raises(PreflightError, match="CPU: the plan asks for 0.5, the cluster has 0.25"):
        preflight.check_resources(plan)


def test_a_gpu_spec_needs_a_node_with_its_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = build_plan(load_spec(TEAMS / "gpu-chat-8b.yaml"))
    _nodes(monkeypatch, {"CPU": 64.0})
    with pytest.raises(PreflightError, match="GPU"):
        preflight.check_resources(plan)


def _workers_answer(monkeypatch: pytest.MonkeyPatch, token_auth: bool) -> None:
    """The worker probe's task answers at once: sluice imported, the cluster's token authentication `token_auth`."""
    import ray

    class Probe:
        def __init__(self, task: object) -> None:
            self.task = task

        def remote(self) -> tuple[str, bool]:
            return "services/replica/llm_replica.py", token_auth

    monkeypatch.setattr(ray, "remote", lambda **options: Probe)
    monkeypatch.setattr(ray, "get", lambda answer, timeout: answer)


def test_a_cluster_beyond_loopback_without_rays_token_is_warned_about(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Serve's inter-deployment gRPC ports bind every interface whatever sluice says; Ray's token is their one guard
    (measured in tests/integration/test_own_cluster.py)."""
    _workers_answer(monkeypatch, token_auth=False)
    preflight.check_workers(on_loopback=False)
    warned = capsys.readouterr().err
    assert warned == preflight.UNGUARDED_CLUSTER + "\n"
    assert "RAY_AUTH_MODE=disabled" in warned and "fix:" in warned
    preflight.check_workers(on_loopback=True)
    _workers_answer(monkeypatch, token_auth=True)
    preflight.check_workers(on_loopback=False)
    assert capsys.readouterr().err == ""


def _running_stacks(monkeypatch: pytest.MonkeyPatch, **frontends: dict[str, Any]) -> None:
    """The cluster's stack records: each stack's frontend section as its record holds it."""
    from sluice.deploy import registry

    records = [
        registry.DeployedStack(stack=stack, source="", spec={"frontend": frontend}, apps=[], deployed_at=0.0)
        for stack, frontend in frontends.items()
    ]
    monkeypatch.setattr(registry, "deployed_stacks", lambda: records)


def test_a_port_another_running_stacks_frontend_holds_is_refused_naming_the_stack_and_the_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = load_spec(TEAMS / "local-cpu.yaml")  # port 8000, metrics 9101
    ports = spec.frontend.listening_ports()
    _running_stacks(monkeypatch, **{"other-chat": {"port": 8000}, spec.stack: {"port": 8000}})
    with pytest.raises(PreflightError) as refused:
        preflight.check_frontend_ports(spec.stack, ports, ["other-chat-frontend", f"{spec.stack}-frontend"])
    assert refused.value.problem == (
        "port 8000 (frontend.port) is held by stack 'other-chat', whose frontend listens there (frontend.port)"
    )
    assert "sluice down other-chat" in refused.value.fix
    # Its metrics port, or the plain-HTTP port beside TLS, clashes as well.
    _running_stacks(monkeypatch, other={"port": 8443, "tls": {"plain_port": spec.frontend.metrics_port}})
    with pytest.raises(PreflightError, match=r"port \d+ \(frontend.metrics_port\) .* \(frontend.tls.plain_port\)"):
        preflight.check_frontend_ports(spec.stack, ports, ["other-frontend"])


def test_a_stack_redeployed_on_its_own_port_or_beside_a_record_whose_frontend_is_gone_goes_ahead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = load_spec(TEAMS / "local-cpu.yaml")
    ports = spec.frontend.listening_ports()
    # A record whose frontend Serve no longer runs (deleted without `sluice down`) holds nothing.
    _running_stacks(
        monkeypatch,
        **{"gone": {"port": 8000}, spec.stack: {"port": 8000}, "elsewhere": {"port": 8001, "metrics_port": 8405}},
    )
    preflight.check_frontend_ports(spec.stack, ports, ["gone-llm", f"{spec.stack}-frontend", "elsewhere-frontend"])
