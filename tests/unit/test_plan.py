"""A spec's plan: the Serve apps it renders to pass Ray's own ServeDeploySchema, and each app's args are what its
builder accepts, for every kind."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from base.contracts import HEAD_NODE_RESOURCE, NODE_ROLE_PER_ACTOR, WORKER_NODE_RESOURCE
from builders.plan import ServeApp, build_plan, serve_config
from builders.specs import load_spec
from infra.haproxy.config import HAProxySettings
from infra.haproxy.lua import render_lua
from services.frontend.app import FrontendArgs
from services.replica.llm_config import LLMAppConfig
from services.router.settings import RouterAppArgs
from sluice.cli.main import main
from sluice.deploy import apply
from sluice.deploy.apply import render
from sluice.deploy.preflight import PREFLIGHT_EXIT_CODE
from sluice.deploy.status import app_roles, degraded_reasons, model_line, prefill_pairs
from topologies.problems import SpecError

TEAMS = Path(__file__).resolve().parents[2] / "topologies" / "teams"


@pytest.mark.parametrize("name", ["local-cpu.yaml", "gpu-chat-8b.yaml"])
def test_a_one_model_stack_renders_to_a_valid_serve_config(name: str) -> None:
    rendered = yaml.safe_load(render(str(TEAMS / name)))
    ServeDeploySchema.model_validate(rendered)
    llm, router, frontend = rendered["applications"]
    for app in (llm, router, frontend):
        module, builder = app["import_path"].split(":")
        assert callable(getattr(importlib.import_module(module), builder))
    engine = LLMAppConfig.model_validate(llm["args"])
    assert RouterAppArgs.model_validate(router["args"]).settings.target_app == llm["name"]
    args = FrontendArgs.model_validate(frontend["args"])
    (served,) = args.apps
    assert (served.llm_app, served.router_app, frontend["route_prefix"]) == (llm["name"], router["name"], None)
    (route,) = HAProxySettings(workdir=Path("/tmp/x"), **args.haproxy).apps
    assert route.replica_route_prefix == llm["route_prefix"] and route.router_route_prefix == router["route_prefix"]
    # The frontend prepends the LLM app's route prefix: its replicas serve vLLM's paths under it.
    assert f'prefix = "{llm["route_prefix"]}"' in render_lua(HAProxySettings(workdir=Path("/tmp/x"), **args.haproxy))
    spec = load_spec(TEAMS / name)
    assert engine.engine.served_model_name == spec.models[0].name
    assert engine.deployment.max_ongoing_requests == spec.models[0].max_ongoing_requests


def test_autoscaling_and_gpus_reach_the_serve_options() -> None:
    plan = build_plan(load_spec(TEAMS / "gpu-chat-8b.yaml"))
    options = LLMAppConfig.model_validate(plan.apps[0].args).deployment.serve_options()
    assert options["autoscaling_config"] == {"min_replicas": 2, "max_replicas": 8, "target_ongoing_requests": 48}
    assert "num_replicas" not in options
    assert options["ray_actor_options"] == {"num_cpus": 8, "num_gpus": 1, "accelerator_type": "H100"}
    assert serve_config(plan)["applications"][0]["name"] == "assistants-chat-8b-llm"


def test_two_models_get_their_own_apps_and_policies_behind_one_frontend() -> None:
    spec = load_spec(TEAMS / "two-models-cpu.yaml")
    plan = build_plan(spec)
    config = serve_config(plan)
    names = [app["name"] for app in config["applications"]]
    assert names == [
        "platform-two-models-cpu-tiny-chat-llm",
        "platform-two-models-cpu-tiny-chat-router",
        "platform-two-models-cpu-tiny-code-llm",
        "platform-two-models-cpu-tiny-code-router",
        "platform-two-models-cpu-frontend",
    ]
    policies = [RouterAppArgs.model_validate(app["args"]).settings.policy for app in config["applications"][1:4:2]]
    assert policies == ["round_robin", "consistent_hash"] == [model.policy for model in plan.models]
    args = FrontendArgs.model_validate(config["applications"][-1]["args"])
    settings = HAProxySettings(workdir=Path("/tmp/x"), **args.haproxy)
    assert [app.model for app in settings.apps] == ["tiny-chat", "tiny-code"] and settings.multi_model
    assert settings.model_lookup_bytes == spec.routing.body_buffer_bytes
    assert [(a.llm_app, a.router_app) for a in args.apps] == [(m.llm_app, m.router_app) for m in plan.models]
    assert [m.replica_backend for m in plan.models] == ["sluice_replicas", "sluice_replicas_1"]


def test_models_whose_app_names_would_collide_are_refused() -> None:
    spec = load_spec(TEAMS / "two-models-cpu.yaml")
    clash = spec.model_copy(
        update={"models": [spec.models[0], spec.models[1].model_copy(update={"name": "Tiny/Chat"})]}
    )
    with pytest.raises(SpecError) as refused:
        build_plan(clash)
    (problem,) = refused.value.problems
    assert problem.path == "models[1].name" and "same app names as models[0]" in problem.message


def _apps(name: str) -> dict[str, dict]:
    rendered = yaml.safe_load(render(str(TEAMS / name)))
    ServeDeploySchema.model_validate(rendered)
    return {app["name"]: app for app in rendered["applications"]}


def test_every_team_file_renders_to_a_valid_serve_config() -> None:
    for path in sorted(TEAMS.glob("*.yaml")):
        for app in _apps(path.name).values():
            module, builder = app["import_path"].split(":")
            assert callable(getattr(importlib.import_module(module), builder)), (path.name, app["name"])


def test_data_parallel_renders_in_engine_ranks_and_rank_gangs() -> None:
    apps = _apps("gpu-data-parallel.yaml")
    moe = LLMAppConfig.model_validate(apps["research-moe-dp-qwen-qwen3-30b-a3b-llm"]["args"])
    dense = LLMAppConfig.model_validate(apps["research-moe-dp-meta-llama-llama-3-1-8b-instruct-llm"]["args"])
    assert (moe.data_parallel.mode, moe.data_parallel.size) == ("ranks", 8)
    options = moe.deployment.serve_options()
    # One gang of 8 rank replicas, scheduled and restarted together.
    assert options["num_replicas"] == 8 and options["gang_scheduling_config"] == {"gang_size": 8}
    assert moe.engine.extra_args["data_parallel_size"] == 8
    assert (dense.data_parallel.mode, dense.deployment.serve_options()["num_replicas"]) == ("in_engine", 2)
    assert "gang_scheduling_config" not in dense.deployment.serve_options()
    assert "--data-parallel-size" in dense.engine.cli_args()
    # GPU replicas leave the CPU-only engine defaults to vLLM; what the spec sets still counts.
    assert dense.engine.max_num_seqs is None and dense.engine.kv_cache_memory_bytes is None
    assert dense.engine.max_model_len == 16384 and "--dtype" not in dense.engine.cli_args()
    plan = build_plan(load_spec(TEAMS / "gpu-data-parallel.yaml"))
    assert [(m.data_parallel, m.data_parallel_size, m.min_replicas) for m in plan.models] == [
        ("ranks", 8, 8),
        ("in_engine", 4, 2),
    ]
    # The in-engine model's router ranks (replica, rank) pairs; a rank gang's replicas are each one rank already.
    routers = [RouterAppArgs.model_validate(apps[m.router_app]["args"]).settings for m in plan.models]
    assert [r.data_parallel_size for r in routers] == [1, 4]


def test_prefill_decode_renders_a_kv_producer_a_kv_consumer_and_a_router_choosing_both() -> None:
    apps = _apps("gpu-prefill-decode.yaml")
    stem = "assistants-chat-70b-pd"
    prefill = LLMAppConfig.model_validate(apps[f"{stem}-prefill"]["args"])
    decode = LLMAppConfig.model_validate(apps[f"{stem}-llm"]["args"])
    router = RouterAppArgs.model_validate(apps[f"{stem}-router"]["args"]).settings
    assert (prefill.prefill_decode.role, decode.prefill_decode.role) == ("prefill", "decode")
    kv = {side: json.loads(c.engine.extra_args["kv_transfer_config"]) for side, c in [("p", prefill), ("d", decode)]}
    assert (kv["p"]["kv_role"], kv["d"]["kv_role"]) == ("kv_producer", "kv_consumer")
    assert kv["p"]["kv_connector"] == "NixlConnector" and kv["p"]["kv_buffer_device"] == "cuda"
    assert kv["p"]["kv_connector_extra_config"]["kv_lease_duration"] == 120
    assert (prefill.deployment.num_replicas, decode.deployment.num_replicas) == (2, 4)
    assert router.target_app == f"{stem}-llm" and router.policy == "consistent_hash"
    assert (router.prefill.app, router.prefill.policy, router.prefill.capacity) == (
        f"{stem}-prefill",
        "power_of_two",
        64,
    )
    args = FrontendArgs.model_validate(apps[f"{stem}-frontend"]["args"])
    # HAProxy pins requests to decode replicas; the prefill app is the router's business.
    assert [(a.llm_app, a.router_app) for a in args.apps] == [(f"{stem}-llm", f"{stem}-router")]


def test_the_cpu_prefill_decode_stack_pairs_its_sides_through_the_router() -> None:
    apps = _apps("prefill-decode-cpu.yaml")
    stem = "platform-prefill-decode-cpu"
    decode = LLMAppConfig.model_validate(apps[f"{stem}-llm"]["args"])
    router = RouterAppArgs.model_validate(apps[f"{stem}-router"]["args"]).settings
    assert decode.prefill_decode.local_prefill_fallback and decode.prefill_decode.prefill_timeout_s == 60
    # The decode replica calls the prefill replica's port under the prefill app's route prefix.
    assert router.prefill.route_prefix == apps[f"{stem}-prefill"]["route_prefix"] == f"/{stem}-prefill"
    # Its decode replicas may prefill locally, so the router pairs them with no prefill replica rather than refuse.
    assert router.prefill.required is False
    assert json.loads(decode.engine.extra_args["kv_transfer_config"])["kv_buffer_device"] == "cpu"


def _report(plan, llm: int, routers: int, replica_up: int, router_up: int, running: bool = True) -> dict:
    llm_app, router_app, frontend_app = (app.name for app in plan.apps)  # a one-model plan
    servers = [
        {"backend": "sluice_replicas", "server": f"r{i}", "status": "UP" if i < replica_up else "DOWN"}
        for i in range(llm)
    ]
    servers += [
        {"backend": "sluice_routers", "server": f"q{i}", "status": "UP" if i < router_up else "DOWN"}
        for i in range(routers)
    ]
    return {
        "apps": {
            llm_app: {"status": "RUNNING", "replicas": [f"r{i}" for i in range(llm)]},
            router_app: {"status": "RUNNING", "replicas": [f"q{i}" for i in range(routers)]},
            frontend_app: {"status": "RUNNING" if running else "DEPLOY_FAILED", "replicas": []},
        },
        "frontend": {"running": running, "servers": servers},
    }


def test_status_says_why_a_stack_is_degraded() -> None:
    spec = load_spec(TEAMS / "local-cpu.yaml")
    plan = build_plan(spec)
    assert degraded_reasons(spec, plan, _report(plan, llm=2, routers=1, replica_up=2, router_up=1)) == []
    assert degraded_reasons(spec, plan, _report(plan, llm=1, routers=1, replica_up=1, router_up=1)) == [
        "1 of 2 LLM replicas running"
    ]
    assert degraded_reasons(spec, plan, _report(plan, llm=2, routers=1, replica_up=1, router_up=0)) == [
        "HAProxy has 1 of 2 LLM replicas UP",
        "HAProxy has 0 of 1 routers UP",
    ]
    assert degraded_reasons(spec, plan, _report(plan, 2, 1, 2, 1, running=False)) == [
        "app platform-local-cpu-frontend is DEPLOY_FAILED",
        "HAProxy is not running",
    ]


def test_a_deploy_deadline_names_what_the_frontend_still_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = build_plan(load_spec(TEAMS / "local-cpu.yaml"))
    [model] = plan.models
    monkeypatch.setattr(apply, "frontend_status", lambda _: None)
    assert "HAProxy is not running" in apply._frontend_lag(plan)
    servers = [
        {"backend": model.replica_backend, "server": "r1", "status": "UP"},
        {"backend": model.replica_backend, "server": "r2", "status": "DOWN"},
        {"backend": model.router_backend, "server": "router1", "status": "MAINT"},
    ]
    monkeypatch.setattr(apply, "frontend_status", lambda _: {"running": True, "published": [1], "servers": servers})
    lag = apply._frontend_lag(plan)
    assert f"{model.name} 1 of 2 replicas published" in lag
    assert f"{model.replica_backend}/r2 DOWN, {model.router_backend}/router1 MAINT" in lag
    assert f"router backends with no router UP: {model.router_backend}" in lag


def test_without_a_cluster_the_cli_says_what_to_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Port 1 on loopback: nothing listens there.
    assert main(["status", str(TEAMS / "local-cpu.yaml"), "--address", "127.0.0.1:1"]) == PREFLIGHT_EXIT_CODE
    assert "no Ray cluster at '127.0.0.1:1'" in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    broken.write_text((TEAMS / "local-cpu.yaml").read_text().replace("replicas: 2", "replicas: 0"))
    assert main(["deploy", str(broken), "--address", "127.0.0.1:1"]) == 1
    assert "models[0].replicas" in capsys.readouterr().err


def test_status_names_the_model_whose_backends_are_short() -> None:
    spec = load_spec(TEAMS / "two-models-cpu.yaml")
    plan = build_plan(spec)
    chat, code = plan.models
    apps = {app.name: {"status": "RUNNING", "replicas": []} for app in plan.apps}
    apps[chat.llm_app]["replicas"], apps[chat.router_app]["replicas"] = ["c1"], ["cr"]
    apps[code.llm_app]["replicas"], apps[code.router_app]["replicas"] = ["k1"], ["kr"]
    servers = [
        {"backend": chat.replica_backend, "server": "c1", "status": "UP"},
        {"backend": chat.router_backend, "server": "cr", "status": "UP"},
        {"backend": code.replica_backend, "server": "k1", "status": "DOWN"},
        {"backend": code.router_backend, "server": "kr", "status": "UP"},
    ]
    report = {"apps": apps, "frontend": {"running": True, "servers": servers}}
    assert degraded_reasons(spec, plan, report) == ["tiny-code: HAProxy has 0 of 1 LLM replicas UP"]
    servers[2]["status"] = "UP"
    assert degraded_reasons(spec, plan, report) == []
    apps[chat.llm_app]["replicas"] = []
    assert degraded_reasons(spec, plan, report) == ["tiny-chat: 0 of 1 LLM replicas running"]


def test_status_shows_roles_and_pairs_and_says_when_the_prefill_side_is_short() -> None:
    spec = load_spec(TEAMS / "prefill-decode-cpu.yaml")
    plan = build_plan(spec)
    [model] = plan.models
    roles = app_roles(plan)
    assert roles[model.prefill_app].startswith("prefill replicas of tiny-pd")
    assert roles[model.llm_app].startswith("decode replicas of tiny-pd")
    assert "decode policy consistent_hash, prefill policy power_of_two" in model_line(model)
    apps = {app.name: {"status": "RUNNING", "replicas": ["x"]} for app in plan.apps}
    servers = [
        {"backend": model.replica_backend, "server": "x", "status": "UP"},
        {"backend": model.router_backend, "server": "x", "status": "UP"},
    ]
    report = {"apps": apps, "frontend": {"running": True, "servers": servers}}
    assert degraded_reasons(spec, plan, report) == []
    apps[model.prefill_app]["replicas"] = []
    assert degraded_reasons(spec, plan, report) == ["0 of 1 prefill replicas running"]
    metrics = (
        "# TYPE sluice_prefill_requests_total counter\n"
        'sluice_prefill_requests_total{outcome="remote",prefill_replica="p1"} 20.0\n'
        'sluice_prefill_requests_total{outcome="local_fallback",prefill_replica=""} 3.0\n'
        'sluice_prefill_requests_created{outcome="remote",prefill_replica="p1"} 1.7e9\n'
    )
    assert prefill_pairs(metrics) == {("p1", "remote"): 20.0, ("", "local_fallback"): 3.0}


@pytest.mark.parametrize("name", ["local-cpu.yaml", "canary-cpu.yaml", "prefill-decode-cpu.yaml"])
def test_a_plan_across_nodes_puts_replicas_on_workers_and_everything_else_on_the_head(name: str) -> None:
    spec = load_spec(TEAMS / name)
    one_machine, across = build_plan(spec), build_plan(spec, spans_nodes=True)
    head = {HEAD_NODE_RESOURCE: NODE_ROLE_PER_ACTOR}
    worker = {WORKER_NODE_RESOURCE: NODE_ROLE_PER_ACTOR}
    llm_apps = {m.llm_app for m in across.models} | {m.prefill_app for m in across.models if m.prefill_app}
    for alone, placed in zip(one_machine.apps, across.apps, strict=True):
        assert placed.name == alone.name
        assert not _actor_options(alone).get("resources"), placed.name
        assert _actor_options(placed)["resources"] == (worker if placed.name in llm_apps else head), placed.name
    frontend = FrontendArgs.model_validate(across.apps[-1].args)
    assert frontend.node_role == "head"


def _actor_options(app: ServeApp) -> dict[str, Any]:
    """The ray_actor_options of the app's ingress deployment, as its Serve builder sets them."""
    module, name = app.import_path.split(":")
    application = getattr(importlib.import_module(module), name)(app.args)
    return application._bound_deployment.ray_actor_options
