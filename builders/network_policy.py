"""The stack's NetworkPolicy in a KubeRay render: what may reach its pods, since Ray's own ports carry no
authentication there (`base.runtime.CLUSTER_NODE_ENV` turns Ray's token authentication off: the stack's network is
its boundary).

Admitted: anything to the frontend's ports (the API and HAProxy's Prometheus exporter); the stack's own pods to every
port (Ray's GCS, object manager and workers, Serve, the replicas' ports HAProxy forwards to); KubeRay's operator to
the head's dashboard and dashboard agent (how it reads a RayService's status). Everything else, Ray's client port and
its GCS included, is refused. Egress stays open: Hub models download.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# The labels of KubeRay's operator pod as its Helm chart sets them, in any namespace.
KUBERAY_OPERATOR_LABELS = {"app.kubernetes.io/name": "kuberay-operator"}
# Ray's dashboard and its agent's HTTP port (Ray's defaults): the operator reads Serve's status through them.
OPERATOR_PORTS = (8265, 52365)


def network_policy(
    name: str, labels: dict[str, str], stack_pods: dict[str, str], public_ports: Sequence[str]
) -> dict[str, Any]:
    """A NetworkPolicy `name` on the pods labelled `stack_pods`: `public_ports` (container port names) from
    anywhere, every port from those pods, the operator's ports from KubeRay's operator."""

    def selector() -> dict[str, Any]:
        return {"matchLabels": dict(stack_pods)}  # a fresh object each time: no YAML anchors in the manifest

    operator = {"namespaceSelector": {}, "podSelector": {"matchLabels": KUBERAY_OPERATOR_LABELS}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "podSelector": selector(),
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": [{"port": port, "protocol": "TCP"} for port in public_ports]},
                {"from": [{"podSelector": selector()}]},
                {"from": [operator], "ports": [{"port": port, "protocol": "TCP"} for port in OPERATOR_PORTS]},
            ],
        },
    }
