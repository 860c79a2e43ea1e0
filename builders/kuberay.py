"""A team's stack on KubeRay: the spec and its plan across nodes become a RayService, a Service for the frontend and
a ConfigMap with the spec.

A head group (frontend, routers, legacy ingress; `num-cpus: 0`), a worker group per pod shape of the LLM
deployments, `serveConfigV2` from the same plan as `sluice render`, sluice's environment in every Ray container, API
keys and HF tokens from Secrets the team creates, the spec mounted on the head (`SPEC_MOUNT`). What each part holds
and why: docs/design.md §2.2; the RayService model: `infra.kuberay`.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from base.contracts import HEAD_NODE_RESOURCE, NODE_BIND_ALL, NODE_ROLE_CAPACITY, WORKER_NODE_RESOURCE
from base.runtime import CLUSTER_NODE_ENV, DEFAULT_SERVE_PROXY_PORT, HF_OFFLINE_ENV, is_local_model, process_env
from builders.kinds.registry import kind_of
from builders.network_policy import network_policy
from builders.plan import StackPlan, build_plan, model_path, serve_config
from infra.haproxy.config import PROMETHEUS_PATH
from infra.kuberay import ObjectMeta, RayService, ray_start_resources
from topologies.sections import Scaling
from topologies.spec import StackBase

DEFAULT_IMAGE = "sluice:cpu"
POD_CACHE_DIR = "/var/cache/sluice"
SPEC_MOUNT = "/etc/sluice-stack"
SPEC_KEY = "spec.yaml"
KEYS_MOUNT = "/etc/sluice-keys"
# The frontend's certificate, key and client CA: the Secret `<stack>-tls`, its keys as `kubectl create secret tls` names
# them (and `ca.crt` for mTLS), mounted on the head; the files are re-read when Kubernetes updates the Secret.
TLS_MOUNT = "/etc/sluice-tls"
TLS_FILES = {"cert_file": "tls.crt", "key_file": "tls.key", "client_ca_file": "ca.crt"}
PLAIN_PORT_NAME = "sluice-plain"
# Ray's own token authentication on every port of the cluster: KubeRay (>= 1.5.1) makes the token's Secret and gives
# it to every Ray container; sluice's processes are Ray's, so they carry it.
RAY_AUTH = {"mode": "token"}
# The head runs GCS, the dashboard, Serve's controller, the frontend (HAProxy) and the routers: ~1 GiB idle here.
HEAD_RESOURCES = {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "4Gi"}}
RAY_HEAD_PORTS = {"gcs-server": 6379, "dashboard": 8265, "client": 10001}
SERVE_PORT_NAME = "serve"
FRONTEND_PORT_NAME = "sluice-http"
METRICS_PORT_NAME = "sluice-metrics"
GPU_RESOURCE = "nvidia.com/gpu"
ACCELERATOR_LABEL = "ray.io/accelerator-type"
HF_TOKEN_KEY = "token"


class PodShape(NamedTuple):
    """What one worker pod asks for: CPU millicores, whole GPUs, the accelerator type."""

    millicpus: int
    gpus: int
    accelerator: str | None

    @property
    def cpu(self) -> str:
        """The Kubernetes CPU quantity."""
        return str(self.millicpus // 1000) if self.millicpus % 1000 == 0 else f"{self.millicpus}m"

    @property
    def name(self) -> str:
        cpu = f"cpu{self.cpu}"
        if not self.gpus:
            return cpu
        kind = re.sub(r"[^a-z0-9]+", "-", self.accelerator.lower()).strip("-") if self.accelerator else "gpu"
        return f"{kind}x{self.gpus}-{cpu}"


class PodCount(NamedTuple):
    replicas: int
    minimum: int
    maximum: int


@contextlib.contextmanager
def _pod_cache_dir() -> Iterator[None]:
    """`SLUICE_CACHE_DIR` as the pods have it, while paths into the cache (model folders, cache variables) are made."""
    before = os.environ.get("SLUICE_CACHE_DIR")
    os.environ["SLUICE_CACHE_DIR"] = POD_CACHE_DIR
    try:
        yield
    finally:
        if before is None:
            del os.environ["SLUICE_CACHE_DIR"]
        else:
            os.environ["SLUICE_CACHE_DIR"] = before


def pod_spec(spec: StackBase) -> StackBase:
    """The spec as the pods see it: a key file is where the head mounts the key Secret (`KEYS_MOUNT`), the TLS files
    where it mounts the TLS Secret (`TLS_MOUNT`), whatever their folders on the machine that renders."""
    frontend = spec.frontend
    keys = frontend.protection.api_keys
    if keys is not None and keys.file is not None:
        moved = keys.model_copy(update={"file": Path(KEYS_MOUNT) / keys.file.name})
        frontend = frontend.model_copy(
            update={"protection": frontend.protection.model_copy(update={"api_keys": moved})}
        )
    if frontend.tls is not None:
        files = {field: Path(TLS_MOUNT) / key for field, key in TLS_FILES.items() if getattr(frontend.tls, field)}
        frontend = frontend.model_copy(update={"tls": frontend.tls.model_copy(update=files)})
    return spec.model_copy(update={"frontend": frontend})


def pod_plan(spec: StackBase) -> StackPlan:
    """The plan across nodes of the spec as the pods see it, its model folders in the pods' cache."""
    with _pod_cache_dir():
        return build_plan(pod_spec(spec), spans_nodes=True)


def _llm_deployments(spec: StackBase) -> Iterator[tuple[Scaling, int]]:
    """(scaling, pods per replica) of each LLM deployment, as the spec's kind says."""
    kind = kind_of(spec)
    for model in spec.models:  # type: ignore[attr-defined]
        yield from kind.llm_deployments(model)


def worker_pods(spec: StackBase) -> dict[PodShape, PodCount]:
    """The worker pods of each shape: now, at least and at most (equal unless a deployment autoscales)."""
    pods: dict[PodShape, PodCount] = {}
    for scaling, per_replica in _llm_deployments(spec):
        resources = scaling.resources
        shape = PodShape(round(resources.cpus * 1000), math.ceil(resources.gpus), resources.accelerator_type)
        if scaling.autoscaling is not None:
            low, high = scaling.autoscaling.min_replicas, scaling.autoscaling.max_replicas
            count = PodCount(low, low, high)
        else:
            count = PodCount(*[scaling.fixed_replicas * per_replica] * 3)
        before = pods.get(shape, PodCount(0, 0, 0))
        pods[shape] = PodCount(*(a + b for a, b in zip(before, count, strict=True)))
    return pods


def from_hub(spec: StackBase) -> bool:
    """Whether a model's weights come from the Hugging Face Hub (not the tiny models, not a folder)."""
    return any(not is_local_model(model_path(model.source)) for model in spec.models)  # type: ignore[attr-defined]


def container_env(spec: StackBase, hub: bool | None = None) -> list[dict[str, Any]]:
    """The variables every Ray container of the stack starts with: no engine's hardware settings (each LLM replica
    brings its own, `base.runtime.engine_env`), Hugging Face offline unless a model comes from the Hub (`hub`:
    whether one does, when the spec alone cannot tell: a platform's cluster holds its teams' models)."""
    with _pod_cache_dir():
        env = {"SLUICE_CACHE_DIR": POD_CACHE_DIR, **process_env(), **CLUSTER_NODE_ENV}
    del env["RAY_AUTH_MODE"]  # KubeRay sets it, with the token (`RAY_AUTH`)
    del env["VLLM_HOST_IP"]
    entries: list[dict[str, Any]] = []
    if from_hub(spec) if hub is None else hub:
        secret = {"name": f"{spec.stack}-hf-token", "key": HF_TOKEN_KEY, "optional": True}
        entries.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": secret}})
    else:
        env |= HF_OFFLINE_ENV
    return [{"name": key, "value": value} for key, value in env.items()] + entries


def stack_pods(spec: StackBase) -> dict[str, str]:
    """The labels every object of the stack carries (its pods' selector)."""
    return {"app.kubernetes.io/name": "sluice", "app.kubernetes.io/instance": spec.stack}


def labels(spec: StackBase, component: str) -> dict[str, str]:
    return {**stack_pods(spec), "app.kubernetes.io/component": component}


def _port(name: str, port: int) -> dict[str, Any]:
    return {"name": name, "containerPort": port, "protocol": "TCP"}


# (env, volumes, mounts) of a head container's API keys.
HeadSecrets = tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]


def _head_secrets(spec: StackBase) -> HeadSecrets:
    """(env, volumes, mounts) the frontend's API keys need on the head: from the Secret `<stack>-api-keys`."""
    keys = spec.frontend.protection.api_keys
    if keys is None:
        return [], [], []
    secret = f"{spec.stack}-api-keys"
    if keys.env is not None:
        return [{"name": keys.env, "valueFrom": {"secretKeyRef": {"name": secret, "key": keys.env}}}], [], []
    name = keys.file.name  # type: ignore[union-attr]
    volume = {"name": "api-keys", "secret": {"secretName": secret, "items": [{"key": name, "path": name}]}}
    return [], [volume], [{"name": "api-keys", "mountPath": KEYS_MOUNT, "readOnly": True}]


def _tls_volume(spec: StackBase) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) of the frontend's TLS files on the head: the Secret `<stack>-tls`."""
    tls = spec.frontend.tls
    if tls is None:
        return [], []
    items = [{"key": key, "path": key} for field, key in TLS_FILES.items() if getattr(tls, field)]
    volume = {"name": "tls", "secret": {"secretName": f"{spec.stack}-tls", "items": items}}
    return [volume], [{"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True}]


def public_ports(spec: StackBase) -> dict[str, int]:
    """The frontend's ports clients reach, by container port name: the API, the metrics, a kept plain-HTTP port."""
    frontend = spec.frontend
    ports = {FRONTEND_PORT_NAME: frontend.port, METRICS_PORT_NAME: frontend.metrics_port}
    if frontend.tls is not None and frontend.tls.plain_port is not None:
        ports[PLAIN_PORT_NAME] = frontend.tls.plain_port
    return ports


def head_group(
    spec: StackBase, image: str, env: list[dict[str, Any]], secrets: HeadSecrets | None = None
) -> dict[str, Any]:
    """The head group; `secrets`: the API keys' (env, volumes, mounts), by default the stack's own."""
    ports = [_port(name, port) for name, port in RAY_HEAD_PORTS.items()]
    ports += [_port(SERVE_PORT_NAME, DEFAULT_SERVE_PROXY_PORT)]
    ports += [_port(name, port) for name, port in public_ports(spec).items()]
    key_env, volumes, mounts = secrets if secrets is not None else _head_secrets(spec)
    tls_volumes, tls_mounts = _tls_volume(spec)
    volumes += tls_volumes
    mounts += tls_mounts
    volumes.append({"name": "stack-spec", "configMap": {"name": f"{spec.stack}-spec"}})
    mounts.append({"name": "stack-spec", "mountPath": SPEC_MOUNT, "readOnly": True})
    container = {
        "name": "ray-head",
        "image": image,
        "env": env + key_env,
        "ports": ports,
        "resources": HEAD_RESOURCES,
        "volumeMounts": mounts,
    }
    params = {"num-cpus": "0", "resources": ray_start_resources({HEAD_NODE_RESOURCE: NODE_ROLE_CAPACITY})}
    template = {
        "metadata": {"labels": labels(spec, "frontend")},
        "spec": {"containers": [container], "volumes": volumes},
    }
    return {"rayStartParams": params, "template": template}


def worker_group(
    spec: StackBase, image: str, env: list[dict[str, Any]], shape: PodShape, count: PodCount
) -> dict[str, Any]:
    resources: dict[str, Any] = {"requests": {"cpu": shape.cpu}}
    ray_resources = {WORKER_NODE_RESOURCE: NODE_ROLE_CAPACITY}
    params = {"num-cpus": str(math.ceil(shape.millicpus / 1000)), "num-gpus": str(shape.gpus)}
    pod: dict[str, Any] = {}
    group: dict[str, Any] = {"groupName": shape.name, "replicas": count.replicas}
    group |= {"minReplicas": count.minimum, "maxReplicas": count.maximum}
    if shape.gpus:
        resources["limits"] = {GPU_RESOURCE: str(shape.gpus)}
        # GPU node pools are commonly tainted for GPU pods only.
        pod["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    if shape.accelerator is not None:
        ray_resources[f"accelerator_type:{shape.accelerator}"] = 1
        group["labels"] = {ACCELERATOR_LABEL: shape.accelerator}
    params["resources"] = ray_start_resources(ray_resources)
    container = {
        "name": "ray-worker",
        "image": image,
        "env": env,
        "ports": [_port(SERVE_PORT_NAME, DEFAULT_SERVE_PROXY_PORT)],
        "resources": resources,
    }
    pod["containers"] = [container]
    template = {"metadata": {"labels": labels(spec, "llm")}, "spec": pod}
    return group | {"rayStartParams": params, "template": template}


def serve_config_v2(plan: StackPlan) -> str:
    """The plan's Serve config with Serve's HTTP options for a stack across pods, as a YAML string."""
    config = {"http_options": {"host": NODE_BIND_ALL, "port": DEFAULT_SERVE_PROXY_PORT}, **serve_config(plan)}
    return yaml.safe_dump(config, sort_keys=False)


def frontend_service(spec: StackBase) -> dict[str, Any]:
    frontend = spec.frontend
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(frontend.metrics_port),
        "prometheus.io/path": PROMETHEUS_PATH,
    }
    ports = [
        {"name": name, "port": port, "targetPort": name, "protocol": "TCP"} for name, port in public_ports(spec).items()
    ]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": f"{spec.stack}-frontend",
            "labels": labels(spec, "frontend"),
            "annotations": annotations,
        },
        "spec": {"type": "ClusterIP", "selector": labels(spec, "frontend"), "ports": ports},
    }


def _spec_config_map(spec: StackBase) -> dict[str, Any]:
    text = yaml.safe_dump(spec.model_dump(mode="json", exclude_unset=True), sort_keys=False)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{spec.stack}-spec", "labels": labels(spec, "spec")},
        "data": {SPEC_KEY: text},
    }


def kuberay_manifests(spec: StackBase, plan: StackPlan, image: str = DEFAULT_IMAGE) -> list[dict[str, Any]]:
    """The stack's Kubernetes objects: its RayService (checked against `infra.kuberay`), the frontend's Service, the
    spec's ConfigMap and the NetworkPolicy that admits only the frontend's ports from outside the stack
    (`builders.network_policy`). `plan`: `pod_plan(spec)`."""
    spec = pod_spec(spec)
    env = container_env(spec)
    pods = worker_pods(spec)
    cluster: dict[str, Any] = {
        "rayVersion": version("ray"),
        "authOptions": RAY_AUTH,
        "headGroupSpec": head_group(spec, image, env),
        "workerGroupSpecs": [worker_group(spec, image, env, shape, count) for shape, count in pods.items()],
    }
    if any(scaling.autoscaling is not None for scaling, _ in _llm_deployments(spec)):
        cluster["enableInTreeAutoscaling"] = True
    service = RayService(
        metadata=ObjectMeta(name=plan.stack, labels=labels(spec, "stack")),
        spec={"serveConfigV2": serve_config_v2(plan), "rayClusterConfig": cluster},
    )
    policy = network_policy(
        f"{spec.stack}-ingress", labels(spec, "network"), stack_pods(spec), list(public_ports(spec))
    )
    return [service.manifest(), frontend_service(spec), _spec_config_map(spec), policy]
