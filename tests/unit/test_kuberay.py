"""`sluice render FILE --kuberay`: every team file gives a RayService that passes the KubeRay model and whose pod
templates, Service and ConfigMap pass Kubernetes' own schema (`kubernetes-validate`, strict); GPUs are asked for on
worker groups only, the head carries the frontend, Ray's KubeRay autoscaler reads the groups' resources as meant, and
serveConfigV2 is the plan across nodes."""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pydantic import ValidationError
from ray.autoscaler._private.kuberay.autoscaling_config import (
    _get_labels_from_group_spec,
    _get_ray_resources_from_group_spec,
)
from ray.serve.schema import ServeDeploySchema

from base.contracts import HEAD_NODE_RESOURCE, NODE_BIND_ALL, NODE_ROLE_CAPACITY, WORKER_NODE_RESOURCE
from base.runtime import DEFAULT_SERVE_PROXY_PORT
from builders.kuberay import (
    GPU_RESOURCE,
    KEYS_MOUNT,
    PLAIN_PORT_NAME,
    POD_CACHE_DIR,
    RAY_HEAD_PORTS,
    SPEC_KEY,
    SPEC_MOUNT,
    TLS_MOUNT,
    kuberay_manifests,
    pod_plan,
    pod_spec,
)
from builders.network_policy import KUBERAY_OPERATOR_LABELS, OPERATOR_PORTS
from builders.plan import serve_config
from builders.specs import load_spec, parse_spec
from infra.kuberay import RayService, parse_ray_start_resources, ray_start_resources
from infra.tls_certs import throwaway_certificate
from sluice.deploy.apply import render
from sluice.deploy.render_kuberay import render_kuberay

TEAMS = sorted((Path(__file__).resolve().parents[2] / "topologies" / "teams").glob("*.yaml"))
GPU_TEAMS = [path for path in TEAMS if path.name.startswith("gpu-")]
KUBERNETES_VERSION = "1.30"


def _rendered(path: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    service, frontend, config_map, _ = yaml.safe_load_all(render_kuberay(str(path), "sluice:test"))
    return service, frontend, config_map


def _network_policy(path: Path) -> dict[str, Any]:
    *_, policy = yaml.safe_load_all(render_kuberay(str(path), "sluice:test"))
    return policy


def _cluster(service: dict[str, Any]) -> dict[str, Any]:
    return service["spec"]["rayClusterConfig"]


def _groups(service: dict[str, Any]) -> list[dict[str, Any]]:
    return _cluster(service)["workerGroupSpecs"]


def _container(group: dict[str, Any]) -> dict[str, Any]:
    return group["template"]["spec"]["containers"][0]


def _as_pod(template: dict[str, Any], name: str) -> dict[str, Any]:
    metadata = {"name": name, **template.get("metadata", {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]}


@pytest.mark.parametrize("path", TEAMS, ids=lambda path: path.stem)
def test_every_team_file_renders_a_manifest_kuberay_and_kubernetes_accept(path: Path) -> None:
    service, frontend, config_map = _rendered(path)
    RayService.model_validate(service)
    cluster = _cluster(service)
    templates = [cluster["headGroupSpec"]["template"]] + [group["template"] for group in _groups(service)]
    assert len(templates) >= 2
    for index, template in enumerate(templates):
        kubernetes_validate.validate(_as_pod(template, f"pod-{index}"), KUBERNETES_VERSION, strict=True)
    for obj in (frontend, config_map):
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_kubernetes_validation_is_strict_about_unknown_pod_fields() -> None:
    service, _, _ = _rendered(TEAMS[0])
    template = copy.deepcopy(_cluster(service)["headGroupSpec"]["template"])
    template["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(_as_pod(template, "pod"), KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("path", GPU_TEAMS, ids=lambda path: path.stem)
def test_gpu_specs_ask_for_nvidia_gpus_on_worker_groups_and_not_on_the_head(path: Path) -> None:
    service, _, _ = _rendered(path)
    head = _container(_cluster(service)["headGroupSpec"])
    assert GPU_RESOURCE not in str(head["resources"])
    for group in _groups(service):
        limits = _container(group)["resources"]["limits"]
        assert int(limits[GPU_RESOURCE]) >= 1
        assert group["rayStartParams"]["num-gpus"] == limits[GPU_RESOURCE]
        accelerator = _get_labels_from_group_spec(group)["ray.io/accelerator-type"]
        assert parse_ray_start_resources(group["rayStartParams"]["resources"])[f"accelerator_type:{accelerator}"] == 1


@pytest.mark.parametrize("path", [path for path in TEAMS if path not in GPU_TEAMS], ids=lambda path: path.stem)
def test_cpu_specs_ask_for_no_gpu(path: Path) -> None:
    service, _, _ = _rendered(path)
    assert GPU_RESOURCE not in yaml.safe_dump(_cluster(service))
    assert all(group["rayStartParams"]["num-gpus"] == "0" for group in _groups(service))


@pytest.mark.parametrize("path", TEAMS, ids=lambda path: path.stem)
def test_the_head_carries_the_frontend_ports_and_the_head_resource_and_its_service_selects_it(path: Path) -> None:
    spec = load_spec(path)
    service, frontend, _ = _rendered(path)
    head = _cluster(service)["headGroupSpec"]
    ports = {port["name"]: port["containerPort"] for port in _container(head)["ports"]}
    assert ports["sluice-http"] == spec.frontend.port
    assert ports["sluice-metrics"] == spec.frontend.metrics_port
    # KubeRay checks Serve's proxy at the port named `serve`, on the head and on every worker.
    assert ports["serve"] == DEFAULT_SERVE_PROXY_PORT
    assert {"gcs-server", "dashboard", "client"} <= ports.keys()
    assert parse_ray_start_resources(head["rayStartParams"]["resources"]) == {HEAD_NODE_RESOURCE: NODE_ROLE_CAPACITY}
    assert head["rayStartParams"]["num-cpus"] == "0"
    selector = frontend["spec"]["selector"].items()
    assert selector <= head["template"]["metadata"]["labels"].items()
    for group in _groups(service):
        assert not selector <= group["template"]["metadata"]["labels"].items()
        assert {port["name"]: port["containerPort"] for port in _container(group)["ports"]} == {
            "serve": DEFAULT_SERVE_PROXY_PORT
        }
    assert frontend["spec"]["type"] == "ClusterIP"
    assert {port["port"]: port["targetPort"] for port in frontend["spec"]["ports"]} == {
        spec.frontend.port: "sluice-http",
        spec.frontend.metrics_port: "sluice-metrics",
    }


@pytest.mark.parametrize("path", TEAMS, ids=lambda path: path.stem)
def test_rays_kuberay_autoscaler_reads_each_groups_resources_as_meant(path: Path) -> None:
    spec = load_spec(path)
    service, _, _ = _rendered(path)
    head = _get_ray_resources_from_group_spec(_cluster(service)["headGroupSpec"], is_head=True)
    assert head["CPU"] == 0 and head[HEAD_NODE_RESOURCE] == NODE_ROLE_CAPACITY
    shapes = set()
    for group in _groups(service):
        resources = _get_ray_resources_from_group_spec(group, is_head=False)
        assert resources[WORKER_NODE_RESOURCE] == NODE_ROLE_CAPACITY and HEAD_NODE_RESOURCE not in resources
        shapes.add((resources["CPU"], resources["GPU"]))
    sides = [
        side
        for model in spec.models
        for side in ([model.prefill, model.decode] if hasattr(model, "prefill") else [model])
    ]
    assert shapes == {(math.ceil(side.resources.cpus), math.ceil(side.resources.gpus)) for side in sides}


def test_worker_groups_follow_the_specs_replicas_ranks_roles_and_autoscaling() -> None:
    counts = {}
    autoscaled = {}
    for path in GPU_TEAMS:
        service, _, _ = _rendered(path)
        counts[path.stem] = {
            group["groupName"]: (group["replicas"], group["minReplicas"], group["maxReplicas"])
            for group in _groups(service)
        }
        autoscaled[path.stem] = _cluster(service).get("enableInTreeAutoscaling", False)
    # Autoscaled between 2 and 8 replicas of one H100 each.
    assert counts["gpu-chat-8b"] == {"h100x1-cpu8": (2, 2, 8)}
    # One gang of 8 one-GPU ranks, and 2 in-engine replicas of 4 GPUs: two shapes, two groups.
    assert counts["gpu-data-parallel"] == {"h100x1-cpu8": (8, 8, 8), "h100x4-cpu16": (2, 2, 2)}
    # 2 prefill and 4 decode replicas of the same shape share one group.
    assert counts["gpu-prefill-decode"] == {"h100x4-cpu16": (6, 6, 6)}
    assert autoscaled == {"gpu-chat-8b": True, "gpu-data-parallel": False, "gpu-prefill-decode": False}


@pytest.mark.parametrize("path", TEAMS, ids=lambda path: path.stem)
def test_serve_config_v2_is_the_plan_across_nodes_with_serve_on_every_interface(path: Path) -> None:
    service, _, _ = _rendered(path)
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)
    assert config["http_options"] == {"host": NODE_BIND_ALL, "port": DEFAULT_SERVE_PROXY_PORT}
    assert config["applications"] == serve_config(pod_plan(load_spec(path)))["applications"]
    local = yaml.safe_load(render(str(path)))["applications"]
    fields = ("name", "route_prefix", "import_path")
    assert [[app[f] for f in fields] for app in config["applications"]] == [[app[f] for f in fields] for app in local]


def test_pods_keep_their_caches_in_the_image_and_leave_vllm_host_ip_to_each_replica() -> None:
    before = os.environ.get("SLUICE_CACHE_DIR")
    path = next(path for path in TEAMS if path.name == "local-cpu.yaml")
    service, _, _ = _rendered(path)
    assert os.environ.get("SLUICE_CACHE_DIR") == before
    for group in [_cluster(service)["headGroupSpec"], *_groups(service)]:
        env = {var["name"]: var.get("value") for var in _container(group)["env"]}
        assert "VLLM_HOST_IP" not in env
        # Ray joins the pods into one cluster only with this set (sluice's one-machine default is 0).
        assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1"
        assert env["SLUICE_CACHE_DIR"] == POD_CACHE_DIR
        for name in ("VLLM_CACHE_ROOT", "HF_HOME", "TORCHINDUCTOR_CACHE_DIR"):
            assert env[name].startswith(POD_CACHE_DIR + "/")
        assert env["HF_HUB_OFFLINE"] == "1"
    llm = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]
    assert llm["args"]["engine"]["model"].startswith(POD_CACHE_DIR + "/")


def test_hub_models_go_online_with_an_optional_token_secret() -> None:
    service, _, _ = _rendered(next(path for path in GPU_TEAMS if path.name == "gpu-chat-8b.yaml"))
    env = {var["name"]: var for var in _container(_groups(service)[0])["env"]}
    assert "HF_HUB_OFFLINE" not in env
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "assistants-chat-8b-hf-token",
        "key": "token",
        "optional": True,
    }


def test_a_key_file_is_its_secret_mounted_as_the_files_folder_on_the_head_only() -> None:
    service, _, _ = _rendered(next(path for path in GPU_TEAMS if path.name == "gpu-chat-8b.yaml"))
    head = _cluster(service)["headGroupSpec"]["template"]["spec"]
    volume = next(v for v in head["volumes"] if "secret" in v)
    assert volume["secret"] == {
        "secretName": "assistants-chat-8b-api-keys",
        "items": [{"key": "assistants-keys.txt", "path": "assistants-keys.txt"}],
    }
    mount = next(m for m in head["containers"][0]["volumeMounts"] if m["name"] == volume["name"])
    assert mount == {"name": volume["name"], "mountPath": KEYS_MOUNT, "readOnly": True}
    # The frontend reads the key file where the Secret is mounted, wherever the file is on the rendering machine.
    frontend = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][-1]
    assert frontend["args"]["haproxy"]["protection"]["api_keys"]["file"] == f"{KEYS_MOUNT}/assistants-keys.txt"
    assert all("volumes" not in group["template"]["spec"] for group in _groups(service))


def _local_cpu_with(protection: dict[str, Any]) -> Any:
    data = yaml.safe_load(next(path for path in TEAMS if path.name == "local-cpu.yaml").read_text())
    data["frontend"]["protection"] = protection
    return parse_spec(data)


def test_a_key_variable_is_read_from_the_secret_on_the_head() -> None:
    spec = _local_cpu_with({"api_keys": {"env": "TEAM_KEYS"}})
    service = kuberay_manifests(spec, pod_plan(spec))[0]
    env = {var["name"]: var for var in _container(_cluster(service)["headGroupSpec"])["env"]}
    assert env["TEAM_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "platform-local-cpu-api-keys", "key": "TEAM_KEYS"}
    assert all("TEAM_KEYS" not in str(_container(group)["env"]) for group in _groups(service))


@pytest.mark.parametrize("path", TEAMS, ids=lambda path: path.stem)
def test_the_config_map_holds_the_spec_as_loaded_mounted_on_the_head(path: Path) -> None:
    service, _, config_map = _rendered(path)
    assert parse_spec(yaml.safe_load(config_map["data"][SPEC_KEY])) == pod_spec(load_spec(path))
    head = _cluster(service)["headGroupSpec"]["template"]["spec"]
    volume = next(v for v in head["volumes"] if "configMap" in v)
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert {"name": volume["name"], "mountPath": SPEC_MOUNT, "readOnly": True} in head["containers"][0]["volumeMounts"]


def test_ray_start_resources_take_kubrays_quoted_form() -> None:
    value = ray_start_resources({HEAD_NODE_RESOURCE: NODE_ROLE_CAPACITY, "accelerator_type:H100": 1})
    assert value == '"{\\"sluice_head\\": 1000, \\"accelerator_type:H100\\": 1}"'
    assert parse_ray_start_resources(value) == {HEAD_NODE_RESOURCE: NODE_ROLE_CAPACITY, "accelerator_type:H100": 1}


def _set(manifest: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    changed = copy.deepcopy(manifest)
    *parents, last = path.split(".")
    node: Any = changed
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[last] = value
    return changed


GROUP = "spec.rayClusterConfig.workerGroupSpecs.0"


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("metadata.name", "9-starts-with-a-digit"),
        ("metadata.name", "a" * 48),
        ("spec.rayClusterConfig.headGroupSpec.rayStartParams.resources", '{"sluice_head": 1000}'),
        (f"{GROUP}.rayStartParams.resources", '"{\\"sluice_worker\\": 0.5}"'),
        (f"{GROUP}.rayStartParams.num-cpus", "0.25"),
        (f"{GROUP}.rayStartParams.labels", "a=b"),
        (f"{GROUP}.minReplicas", 3),
        (f"{GROUP}.groupName", "CPU_group"),
        (f"{GROUP}.labels", {"ray.io/accelerator-type": "H100 80GB"}),
        (f"{GROUP}.template.spec", {"containers": []}),
        (f"{GROUP}.maxReplicass", 3),
        ("spec.serveConfigV2", "applications: []\n"),
    ],
)
def test_the_rayservice_model_refuses_what_kuberay_refuses(path: str, value: Any) -> None:
    service, _, _ = _rendered(next(p for p in TEAMS if p.name == "local-cpu.yaml"))
    RayService.model_validate(service)
    with pytest.raises(ValidationError):
        RayService.model_validate(_set(service, path, value))


def test_duplicate_worker_group_names_are_refused() -> None:
    service, _, _ = _rendered(next(p for p in TEAMS if p.name == "local-cpu.yaml"))
    groups = _groups(service)
    with pytest.raises(ValidationError, match="repeat"):
        RayService.model_validate(_set(service, "spec.rayClusterConfig.workerGroupSpecs", groups + groups))


@pytest.mark.parametrize("path", TEAMS, ids=lambda path: path.stem)
def test_the_network_policy_admits_only_the_frontends_ports_from_outside_the_stack(path: Path) -> None:
    """Ray's ports carry no authentication in a rendered stack: its NetworkPolicy (Kubernetes' schema) selects every
    pod of the stack, admits the frontend Service's ports from anywhere, every port from the stack's own pods, and
    KubeRay's operator on the dashboard's ports only."""
    policy = _network_policy(path)
    kubernetes_validate.validate(policy, KUBERNETES_VERSION, strict=True)
    service, frontend, _ = _rendered(path)
    selector = policy["spec"]["podSelector"]["matchLabels"]
    cluster = _cluster(service)
    templates = [cluster["headGroupSpec"]["template"]] + [group["template"] for group in _groups(service)]
    assert all(selector.items() <= template["metadata"]["labels"].items() for template in templates)
    public, own, operator = policy["spec"]["ingress"]
    assert "from" not in public and {p["port"] for p in public["ports"]} == {
        port["targetPort"] for port in frontend["spec"]["ports"]
    }
    assert own == {"from": [{"podSelector": {"matchLabels": selector}}]} and "ports" not in own
    assert operator["from"][0]["podSelector"]["matchLabels"] == KUBERAY_OPERATOR_LABELS
    assert {p["port"] for p in operator["ports"]} == set(OPERATOR_PORTS)
    opened = {p["port"] for rule in (public, operator) for p in rule["ports"]}
    assert not (set(RAY_HEAD_PORTS.values()) - {RAY_HEAD_PORTS["dashboard"]}) & opened
    assert policy["spec"]["policyTypes"] == ["Ingress"]


def test_tls_comes_from_the_stacks_tls_secret_on_the_head_and_its_plain_port_is_public(tmp_path: Path) -> None:
    certs = throwaway_certificate(tmp_path / "certs")
    data = yaml.safe_load((TEAMS[0]).read_text())
    data["frontend"]["tls"] = {"cert_file": str(certs.cert), "key_file": str(certs.key), "plain_port": 8080}
    data["frontend"]["tls"]["client_ca_file"] = str(certs.ca)
    spec_file = tmp_path / "stack.yaml"
    spec_file.write_text(yaml.safe_dump(data))
    rendered = render_kuberay(str(spec_file), "sluice:test")
    assert f"kubectl create secret generic {load_spec(spec_file).stack}-tls" in rendered
    service, frontend, config_map, policy = yaml.safe_load_all(rendered)
    group = _cluster(service)["headGroupSpec"]
    kubernetes_validate.validate(_as_pod(group["template"], "head"), KUBERNETES_VERSION, strict=True)
    volume = next(v for v in group["template"]["spec"]["volumes"] if v["name"] == "tls")
    assert {item["key"] for item in volume["secret"]["items"]} == {"tls.crt", "tls.key", "ca.crt"}
    assert {"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True} in _container(group)["volumeMounts"]
    # The frontend (serveConfigV2) and the spec the head holds read the files where the Secret is mounted.
    frontend_args = next(
        app["args"]
        for app in yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
        if app["name"].endswith("-frontend")
    )
    assert frontend_args["haproxy"]["tls"]["cert_file"] == f"{TLS_MOUNT}/tls.crt"
    assert yaml.safe_load(config_map["data"][SPEC_KEY])["frontend"]["tls"]["key_file"] == f"{TLS_MOUNT}/tls.key"
    public = {p["port"] for p in policy["spec"]["ingress"][0]["ports"]}
    assert public == {p["targetPort"] for p in frontend["spec"]["ports"]} and PLAIN_PORT_NAME in public
    assert {"name": PLAIN_PORT_NAME, "containerPort": 8080, "protocol": "TCP"} in _container(group)["ports"]


@pytest.mark.parametrize("path", TEAMS, ids=lambda path: path.stem)
def test_rays_token_authentication_is_on_and_no_container_turns_it_off(path: Path) -> None:
    service, _, _ = _rendered(path)
    cluster = _cluster(service)
    assert cluster["authOptions"] == {"mode": "token"}
    for group in [cluster["headGroupSpec"], *_groups(service)]:
        assert "RAY_AUTH_MODE" not in {entry["name"] for entry in _container(group)["env"]}


PLATFORMS = Path(__file__).resolve().parents[2] / "topologies" / "platforms"


def test_a_platform_and_its_attached_stacks_render_as_one_rayservice_kuberay_and_kubernetes_accept() -> None:
    teams = [str(PLATFORMS / "alpha-chat.yaml"), str(PLATFORMS / "beta-chat.yaml")]
    service, frontend, config_map, policy = yaml.safe_load_all(
        render_kuberay(str(PLATFORMS / "local-cpu.yaml"), "sluice:test", teams)
    )
    RayService.model_validate(service)
    cluster = _cluster(service)
    templates = [cluster["headGroupSpec"]["template"]] + [group["template"] for group in _groups(service)]
    for index, template in enumerate(templates):
        kubernetes_validate.validate(_as_pod(template, f"pod-{index}"), KUBERNETES_VERSION, strict=True)
    for obj in (frontend, config_map, policy):
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)
    apps = {app["name"]: app for app in config["applications"]}
    assert set(apps) == {
        "local-platform-frontend",
        *(f"{team}-chat-{part}" for team in ("alpha", "beta") for part in ("llm", "router", "frontend")),
    }
    # Everything but the LLM replicas on the head; the tenants' keys where the head mounts their Secret.
    assert apps["local-platform-frontend"]["args"]["node_role"] == "head"
    keys = [tenant["api_keys"]["file"] for tenant in apps["local-platform-frontend"]["args"]["tenants"]]
    assert keys == [f"{KEYS_MOUNT}/alpha.keys", f"{KEYS_MOUNT}/beta.keys"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    secret = next(volume["secret"] for volume in head["volumes"] if "secret" in volume)
    assert secret["secretName"] == "local-platform-api-keys"
    assert [item["key"] for item in secret["items"]] == ["alpha.keys", "beta.keys"]
    assert {port["containerPort"] for port in _container(cluster["headGroupSpec"])["ports"]} >= {8000, 8404}
    # One LLM replica per team, of one pod shape: one group of two pods.
    assert [(group["replicas"], group["minReplicas"], group["maxReplicas"]) for group in _groups(service)] == [
        (2, 2, 2)
    ]
    assert {port["port"] for port in frontend["spec"]["ports"]} == {8000, 8404}
    assert set(config_map["data"]) == {SPEC_KEY, "alpha-chat.yaml", "beta-chat.yaml"}


def test_an_attached_stack_renders_only_with_its_platform() -> None:
    with pytest.raises(ValueError, match=r"--kuberay --attach \S+alpha-chat.yaml"):
        render_kuberay(str(PLATFORMS / "alpha-chat.yaml"), "sluice:test")
    with pytest.raises(ValueError, match="not a platform file"):
        render_kuberay(str(TEAMS[0]), "sluice:test", [str(PLATFORMS / "alpha-chat.yaml")])
    with pytest.raises(ValueError, match="frontend.platform is not 'local'"):
        render_kuberay(str(PLATFORMS / "local-cpu.yaml"), "sluice:test", [str(TEAMS[0])])
