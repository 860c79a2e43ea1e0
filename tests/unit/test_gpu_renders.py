"""What a team file's LLM replicas run with, as rendered: a GPU replica gets neither the CPU engine settings nor
Hugging Face offline mode for a Hub model, and its engine arguments leave the CPU-only defaults to vLLM; a CPU
replica of the tiny model keeps both (the CPU path as before). Checked on the plan `sluice deploy` runs (each LLM
app's Serve deployment), on the KubeRay render (worker pods, serveConfigV2) and on `sluice validate`'s engine check.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from base.runtime import CPU_ENGINE_ENV, HF_OFFLINE_ENV, carried_env, engine_env
from builders.kuberay import GPU_RESOURCE, kuberay_manifests, pod_plan
from builders.plan import build_plan, import_path
from builders.specs import engine_problems, load_spec
from services.replica.llm_config import CPU_ONLY_DEFAULTS, EngineConfig, LLMAppConfig, ReplicaDeploymentConfig
from services.replica.llm_replica import build_llm_application, llm_deployment
from topologies.spec import ModelBase, StackBase

TEAMS = sorted((Path(__file__).resolve().parents[2] / "topologies" / "teams").glob("*.yaml"))
LLM_APP = import_path(build_llm_application)


def _sections(spec: StackBase) -> list[Any]:
    """Every part of the spec that asks for replicas: a model, or each role of a prefill/decode model."""
    models: list[ModelBase] = spec.models  # type: ignore[attr-defined]
    roles = [getattr(model, role) for model in models for role in ("prefill", "decode") if hasattr(model, role)]
    return [model for model in models if not hasattr(model, "prefill")] + roles


def _asks_for_gpus(path: Path) -> bool:
    return any(section.resources.gpus > 0 for section in _sections(load_spec(path)))


GPU_TEAMS = [path for path in TEAMS if _asks_for_gpus(path)]
CPU_TEAMS = [path for path in TEAMS if not _asks_for_gpus(path)]


def test_the_team_files_include_gpu_and_cpu_stacks() -> None:
    assert {path.name for path in GPU_TEAMS} == {
        "gpu-chat-8b.yaml",
        "gpu-data-parallel.yaml",
        "gpu-prefill-decode.yaml",
    }
    assert "local-cpu.yaml" in {path.name for path in CPU_TEAMS}


def _llm_apps(applications: list[dict[str, Any]]) -> list[LLMAppConfig]:
    configs = [LLMAppConfig.model_validate(app["args"]) for app in applications if app["import_path"] == LLM_APP]
    assert configs
    return configs


def _pods(service: dict[str, Any]) -> list[dict[str, Any]]:
    """The head group and the worker groups of a rendered RayService."""
    cluster = service["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]


def _pod_env(group: dict[str, Any]) -> dict[str, str | None]:
    return {var["name"]: var.get("value") for var in group["template"]["spec"]["containers"][0]["env"]}


def _as_driver(monkeypatch: pytest.MonkeyPatch, env_vars: dict[str, str]) -> None:
    """This process as a Ray driver whose job runtime_env has `env_vars` (what `connect` gives `sluice deploy`)."""
    from ray.runtime_env import RuntimeEnv

    import services.replica.llm_replica as llm_replica

    class Context:
        runtime_env = RuntimeEnv(env_vars=env_vars)

    monkeypatch.setattr(llm_replica.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(llm_replica.ray, "get_runtime_context", Context)


def _assert_engine_env(env: Mapping[str, str | None], cpu: bool, offline: bool) -> None:
    """The CPU engine settings and Hub offline mode in `env` exactly where the hardware and the weights call for them
    (on a node's pods `cpu` is False: each LLM replica adds its engine's own)."""
    for wanted, variables in ((cpu, CPU_ENGINE_ENV), (offline, HF_OFFLINE_ENV)):
        assert variables.items() <= env.items() if wanted else not env.keys() & variables.keys(), env


def _replica_env(config: LLMAppConfig) -> dict[str, str]:
    """The variables the LLM app's Serve deployment gives its replicas (what `build_llm_application` deploys)."""
    return llm_deployment(config).ray_actor_options["runtime_env"]["env_vars"]


def _set_by_spec(spec: StackBase, served_model_name: str) -> set[str]:
    """The engine arguments the spec itself sets for a model (or any of its roles)."""
    model = next(m for m in spec.models if m.name == served_model_name)  # type: ignore[attr-defined]
    roles = [getattr(model, role) for role in ("prefill", "decode") if hasattr(model, role)]
    return set(model.engine).union(*(role.engine for role in roles))


def _cpu_defaults(spec: StackBase, engine: EngineConfig) -> dict[str, Any]:
    """The engine's CPU-only defaults that the spec does not set."""
    unset = set(CPU_ONLY_DEFAULTS) - _set_by_spec(spec, engine.served_model_name)
    assert unset
    return {key: getattr(engine, key) for key in unset}


def _assert_cpu_defaults_left_to_vllm(spec: StackBase, engine: EngineConfig) -> None:
    defaults = _cpu_defaults(spec, engine)
    assert defaults == dict.fromkeys(defaults)


def _assert_gpu_engine(spec: StackBase, config: LLMAppConfig) -> None:
    """A GPU replica: no CPU settings, Hub models online, CPU-only defaults left to vLLM (unless the spec sets them)."""
    assert config.deployment.num_gpus > 0
    _assert_engine_env(_replica_env(config), cpu=False, offline=False)
    assert not config.engine.model.startswith("/")
    _assert_cpu_defaults_left_to_vllm(spec, config.engine)


@pytest.mark.parametrize("path", GPU_TEAMS, ids=lambda path: path.stem)
def test_a_gpu_stacks_deployed_replicas_run_vllms_gpu_defaults_online(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _as_driver(monkeypatch, carried_env())
    spec = load_spec(path)
    plan = build_plan(spec)
    for config in _llm_apps([app.model_dump() for app in plan.apps]):
        _assert_gpu_engine(spec, config)


@pytest.mark.parametrize("path", GPU_TEAMS, ids=lambda path: path.stem)
def test_a_gpu_stacks_kuberay_pods_and_replicas_run_vllms_gpu_defaults_online(path: Path) -> None:
    spec = load_spec(path)
    service = kuberay_manifests(spec, pod_plan(spec))[0]
    workers = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert all(GPU_RESOURCE in g["template"]["spec"]["containers"][0]["resources"]["limits"] for g in workers)
    for group in _pods(service):
        _assert_engine_env(_pod_env(group), cpu=False, offline=False)
        assert "HF_TOKEN" in _pod_env(group)
    for config in _llm_apps(yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]):
        _assert_gpu_engine(spec, config)


@pytest.mark.parametrize("path", GPU_TEAMS, ids=lambda path: path.stem)
def test_validate_checks_a_gpu_stacks_engine_arguments_with_vllms_gpu_defaults(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checked: list[EngineConfig] = []
    monkeypatch.setattr("services.replica.vllm_app.check_engine_args", checked.append)
    spec = load_spec(path)
    assert engine_problems(spec) == []
    assert len(checked) == sum(1 + 2 * hasattr(model, "prefill") for model in spec.models)  # type: ignore[attr-defined]
    for config in checked:
        _assert_cpu_defaults_left_to_vllm(spec, config)


@pytest.mark.parametrize("path", CPU_TEAMS, ids=lambda path: path.stem)
def test_a_cpu_stacks_replicas_keep_the_cpu_engine_settings_and_stay_offline(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _as_driver(monkeypatch, carried_env())
    spec = load_spec(path)
    service = kuberay_manifests(spec, pod_plan(spec))[0]
    deployed = [app.model_dump() for app in build_plan(spec).apps]
    rendered = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    for config in _llm_apps(deployed) + _llm_apps(rendered):
        _assert_engine_env(_replica_env(config), cpu=True, offline=True)
        defaults = _cpu_defaults(spec, config.engine)
        assert defaults == {key: EngineConfig.model_fields[key].default for key in defaults}
    for group in _pods(service):
        _assert_engine_env(_pod_env(group), cpu=False, offline=True)


def test_the_engine_settings_follow_the_hardware_and_the_weights_separately() -> None:
    assert engine_env("/weights/llama", gpus=True) == HF_OFFLINE_ENV
    assert engine_env("meta-llama/Llama-3.1-8B-Instruct", gpus=False) == CPU_ENGINE_ENV
    assert engine_env("meta-llama/Llama-3.1-8B-Instruct", gpus=True) == {}
    # What every process gets carries neither: only an LLM replica adds its engine's.
    assert not carried_env().keys() & (CPU_ENGINE_ENV.keys() | HF_OFFLINE_ENV.keys())


def test_a_replica_keeps_the_drivers_variables_under_its_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve gives the driver's runtime_env only to a deployment without its own: the replica's must include it."""
    _as_driver(monkeypatch, {"HF_HOME": "/cache/hf", "VLLM_CPU_KVCACHE_SPACE": "4"})
    config = LLMAppConfig(engine=EngineConfig(model="/m"), deployment=ReplicaDeploymentConfig())
    assert _replica_env(config) == {"HF_HOME": "/cache/hf", **CPU_ENGINE_ENV, **HF_OFFLINE_ENV}
