"""`sluice render FILE --kuberay`: a team's stack as Kubernetes manifests for KubeRay (`builders.kuberay`), one
multi-document YAML for `kubectl apply -f`, headed by what must exist first. Multi-line strings (the Serve config,
the spec) are YAML literal blocks, so the manifest reads like the files they come from."""

from __future__ import annotations

from typing import Any

import yaml

from builders.kuberay import HF_TOKEN_KEY, TLS_FILES, from_hub, kuberay_manifests, pod_plan
from builders.platform_kuberay import platform_manifests
from builders.specs import load_spec
from topologies.platform import is_platform_file, load_platform


class _Dumper(yaml.SafeDumper):
    pass


def _string(dumper: yaml.SafeDumper, value: str) -> Any:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _string)


def render_kuberay(path: str, image: str, attached: list[str] | None = None) -> str:
    """The stack of the spec file at `path` as a RayService, the frontend's Service, the spec's ConfigMap and the
    stack's NetworkPolicy, for pods running `image`; a platform file with the stacks `attached` to it, as one."""
    attached = attached or []
    if is_platform_file(path):
        return _render_platform(path, image, attached)
    if attached:
        raise ValueError(f"--attach: {path} is not a platform file (`kind: platform`)")
    spec = load_spec(path)
    if spec.frontend.attached:
        raise ValueError(
            f"{path}: frontend.platform: a stack attached to a platform renders with it, in one RayService: "
            f"`sluice render <platform file> --kuberay --attach {path}`"
        )
    plan = pod_plan(spec)
    stack = plan.stack
    lines = [
        f"# Rendered by `sluice render {path} --kuberay --image {image}`:",
        "# `kubectl apply -f` it where KubeRay (>= 1.5.1) runs. The image holds sluice and its engine (and, for",
        "# `source: tiny`, the tiny model in its cache).",
        f"# Clients reach the frontend at the Service `{stack}-frontend`; the NetworkPolicy `{stack}-ingress` admits",
        "# nothing else from outside the stack (Ray's ports carry no authentication: docs/stacks.md).",
    ]
    if from_hub(spec):
        lines.append(f"# Hub models read HF_TOKEN from the optional Secret `{stack}-hf-token`, key `{HF_TOKEN_KEY}`.")
    if spec.frontend.tls is not None:
        files = " ".join(
            f"--from-file={key}=<{field}>" for field, key in TLS_FILES.items() if getattr(spec.frontend.tls, field)
        )
        lines.append(f"# Create first the Secret `{stack}-tls`: kubectl create secret generic {stack}-tls {files}")
    keys = spec.frontend.protection.api_keys
    if keys is not None:
        key = keys.env if keys.env is not None else keys.file.name  # type: ignore[union-attr]
        lines.append(f"# Create first the Secret `{stack}-api-keys` holding the key list as its key `{key}`.")
    manifests = kuberay_manifests(spec, plan, image)
    return "\n".join(lines) + "\n" + yaml.dump_all(manifests, Dumper=_Dumper, sort_keys=False)


def _render_platform(path: str, image: str, attached: list[str]) -> str:
    platform = load_platform(path)
    teams = [load_spec(team) for team in attached]
    stack = platform.stack
    lines = [
        f"# Rendered by `sluice render {path} --kuberay --image {image}"
        + "".join(f" --attach {team}" for team in attached)
        + "`:",
        "# `kubectl apply -f` it where KubeRay (>= 1.5.1) runs: the platform and its stacks in one Ray cluster.",
        f"# Clients reach the platform at the Service `{stack}-frontend`; create first the Secret `{stack}-api-keys`",
        "# holding each tenant's key list as a key named as its file (or its variable).",
    ]
    manifests = platform_manifests(platform, teams, image)
    return "\n".join(lines) + "\n" + yaml.dump_all(manifests, Dumper=_Dumper, sort_keys=False)
