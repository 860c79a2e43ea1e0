"""A platform and the stacks attached to it on KubeRay: one RayService, since they share one Ray cluster (the
attachment records live in its KV store, and the platform reaches each team's frontend on the head).

Its `serveConfigV2` holds the platform's app and every attached stack's apps, each planned across nodes as
`builders.kuberay` plans a stack; its head group carries the platform's public ports and its tenants' key Secret; its
worker groups are the stacks' LLM pods, one group per pod shape over all of them. A Service for the platform's
ports, a ConfigMap with the platform file and each stack's spec, and the NetworkPolicy that admits only the
platform's ports from outside. Each tenant's key file is a key of the Secret `<platform>-platform-api-keys`, named
as the file (a key variable: its name), mounted on the head as a folder (a rotated Secret reaches the syncer).
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path
from typing import Any

import yaml

from builders.kuberay import (
    KEYS_MOUNT,
    RAY_AUTH,
    SPEC_KEY,
    HeadSecrets,
    PodCount,
    PodShape,
    container_env,
    from_hub,
    frontend_service,
    head_group,
    labels,
    pod_plan,
    public_ports,
    serve_config_v2,
    stack_pods,
    worker_group,
    worker_pods,
)
from builders.network_policy import network_policy
from builders.plan_types import StackPlan
from builders.platform import build_platform_plan
from infra.kuberay import ObjectMeta, RayService
from topologies.platform import PlatformSpec
from topologies.spec import StackBase


class PlatformRenderError(ValueError):
    """The platform and its stacks cannot render together (the message says why)."""


def pod_platform(platform: PlatformSpec) -> PlatformSpec:
    """The platform as the pods see it: each tenant's key file where the head mounts the key Secret."""
    tenants = [
        tenant.model_copy(
            update={
                "api_keys": tenant.api_keys.model_copy(update={"file": Path(KEYS_MOUNT) / tenant.api_keys.file.name})
            }
        )
        if tenant.api_keys.file is not None
        else tenant
        for tenant in platform.tenants
    ]
    return platform.model_copy(update={"tenants": tenants})


def _key_names(platform: PlatformSpec) -> list[str]:
    """Each tenant's key Secret entry: its file's name, or its variable's."""
    names = [
        tenant.api_keys.file.name if tenant.api_keys.file else str(tenant.api_keys.env) for tenant in platform.tenants
    ]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise PlatformRenderError(f"tenants' key files (or variables) share a name, {twice}: one Secret key each")
    return names


def _tenant_secrets(platform: PlatformSpec) -> HeadSecrets:
    secret = f"{platform.stack}-api-keys"
    env = [
        {"name": tenant.api_keys.env, "valueFrom": {"secretKeyRef": {"name": secret, "key": tenant.api_keys.env}}}
        for tenant in platform.tenants
        if tenant.api_keys.env is not None
    ]
    files = [name for tenant, name in zip(platform.tenants, _key_names(platform), strict=True) if tenant.api_keys.file]
    if not files:
        return env, [], []
    volume = {"name": "api-keys", "secret": {"secretName": secret, "items": [{"key": n, "path": n} for n in files]}}
    return env, [volume], [{"name": "api-keys", "mountPath": KEYS_MOUNT, "readOnly": True}]


def _check_attached(platform: PlatformSpec, teams: list[StackBase]) -> None:
    models: dict[str, str] = {}
    for team in teams:
        if team.frontend.platform != platform.name:
            raise PlatformRenderError(f"{team.stack}: frontend.platform is not {platform.name!r}")
        for model in team.models:  # type: ignore[attr-defined]
            if models.setdefault(model.name, team.stack) != team.stack:
                raise PlatformRenderError(f"model {model.name!r} is both {models[model.name]}'s and {team.stack}'s")


def platform_manifests(platform: PlatformSpec, teams: list[StackBase], image: str) -> list[dict[str, Any]]:
    """The RayService of the platform with its attached stacks, the platform's Service, the specs' ConfigMap and the
    NetworkPolicy."""
    _check_attached(platform, teams)
    platform = pod_platform(platform)
    head_plan = build_platform_plan(platform, spans_nodes=True)
    team_plans = [pod_plan(team) for team in teams]
    plan = StackPlan(
        stack=platform.stack,
        apps=[*head_plan.apps, *(app for team in team_plans for app in team.apps)],
        models=[model for team in team_plans for model in team.models],
        url=head_plan.url,
    )
    spec: Any = platform  # the head's side: the platform's frontend, ports and name
    env = container_env(spec, hub=any(from_hub(team) for team in teams))
    pods: dict[PodShape, PodCount] = {}
    for team in teams:
        for shape, count in worker_pods(team).items():
            before = pods.get(shape, PodCount(0, 0, 0))
            pods[shape] = PodCount(*(a + b for a, b in zip(before, count, strict=True)))
    cluster: dict[str, Any] = {
        "rayVersion": version("ray"),
        "authOptions": RAY_AUTH,
        "headGroupSpec": head_group(spec, image, env, _tenant_secrets(platform)),
        "workerGroupSpecs": [worker_group(spec, image, env, shape, count) for shape, count in pods.items()],
    }
    if any(count.minimum != count.maximum for count in pods.values()):
        cluster["enableInTreeAutoscaling"] = True
    service = RayService(
        metadata=ObjectMeta(name=platform.stack, labels=labels(spec, "stack")),
        spec={"serveConfigV2": serve_config_v2(plan), "rayClusterConfig": cluster},
    )
    specs = {SPEC_KEY: yaml.safe_dump(platform.model_dump(mode="json", exclude_unset=True), sort_keys=False)}
    specs |= {f"{team.stack}.yaml": yaml.safe_dump(team.model_dump(mode="json", exclude_unset=True)) for team in teams}
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{platform.stack}-spec", "labels": labels(spec, "spec")},
        "data": specs,
    }
    policy = network_policy(
        f"{platform.stack}-ingress", labels(spec, "network"), stack_pods(spec), list(public_ports(spec))
    )
    return [service.manifest(), frontend_service(spec), config_map, policy]
