"""`sluice render FILE --kuberay`: a team's stack as Kubernetes manifests for KubeRay (`builders.kuberay`), one
multi-document YAML for `kubectl apply -f`, headed by what must exist first. Multi-line strings (the Serve config,
the spec) are YAML literal blocks, so the manifest reads like the files they come from."""

from __future__ import annotations

from typing import Any

import yaml

from builders.kuberay import HF_TOKEN_KEY, TLS_FILES, from_hub, kuberay_manifests, pod_plan
from builders.specs import load_spec
from topologies.platform import is_platform_file

# A platform and its attached stacks share one Ray cluster (the attachment records live in its KV store, the platform
# reaches each team's frontend on the head), so they would render as one RayService together: not built yet.
_PLATFORMS_NOT_RENDERED = (
    "a platform and the stacks attached to it do not render for KubeRay yet (they must share one Ray cluster); "
    "deploy them with `sluice deploy` onto one Ray cluster"
)


class _Dumper(yaml.SafeDumper):
    pass


def _string(dumper: yaml.SafeDumper, value: str) -> Any:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _string)


def render_kuberay(path: str, image: str) -> str:
    """The stack of the spec file at `path` as a RayService, the frontend's Service, the spec's ConfigMap and the
    stack's NetworkPolicy, for pods running `image`."""
    if is_platform_file(path):
        raise ValueError(f"{path}: {_PLATFORMS_NOT_RENDERED}")
    spec = load_spec(path)
    if spec.frontend.attached:
        raise ValueError(f"{path}: frontend.platform: {_PLATFORMS_NOT_RENDERED}")
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
