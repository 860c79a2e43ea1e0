"""Data parallel across replicas (`ranks`) on CPU, as far as vLLM goes here: the moe-ranks-cpu team file (own name
and ports) deployed from its plan onto the session's Ray cluster: one gang of two Serve replicas of the tiny MoE
model, each one vLLM DP rank. Each engine starts only once the DP group has formed, so two running replicas
answering as ranks 0 and 1, each engine reporting under its rank, is the group. A killed rank takes its gang
down and Serve brings the whole gang back, every rank filled again. No completion is sent: vLLM's CPU
communicator lacks the `all_gatherv` MoE data parallelism needs (serving `ranks` needs GPUs)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import ray

from base.contracts import SERVED_RANK_HEADER
from base.waiting import wait_until
from builders.plan import StackPlan
from services.internal_credential import internal_headers
from services.serve_internals import ReplicaEndpoint, list_replica_endpoints
from tests.support.team_stack import team_stack

pytestmark = pytest.mark.integration

GANG_SIZE = 2
_ENGINE_LABELS = re.compile(r'^vllm:num_requests_running\{[^}]*engine="(\d+)"', re.M)


@dataclass
class GangStack:
    plan: StackPlan
    app: str
    path: Path


@pytest.fixture(scope="module")
def stack(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GangStack]:
    with team_stack("moe-ranks-cpu.yaml", "gang-test", tmp_path_factory.mktemp("rank-gang")) as deployed:
        yield GangStack(deployed.plan, deployed.plan.models[0].llm_app, deployed.path)


def ranks(stack: GangStack) -> dict[int, ReplicaEndpoint]:
    """The running replicas by the DP rank each answers as, checked against the rank its engine reports under."""
    by_rank = {}
    for endpoint in asyncio.run(list_replica_endpoints(stack.app)):
        response = httpx.get(f"{endpoint.url}/{stack.app}/v1/models", timeout=10, headers=internal_headers())
        assert response.status_code == 200, response.text
        rank = int(response.headers[SERVED_RANK_HEADER])
        engines = set(_ENGINE_LABELS.findall(httpx.get(f"{endpoint.url}/{stack.app}/metrics", timeout=10).text))
        assert engines == {str(rank)}, (rank, engines)
        by_rank[rank] = endpoint
    return by_rank


def test_the_gang_forms_its_dp_group_with_every_rank(stack: GangStack) -> None:
    by_rank = ranks(stack)
    assert sorted(by_rank) == list(range(GANG_SIZE))
    # `sluice status` lists each rank replica with its rank.
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sluice.cli.main",
            "status",
            str(stack.path),
            "--address",
            ray.get_runtime_context().gcs_address,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    listed = json.loads(result.stdout)["apps"][stack.app]["replicas"]
    assert sorted((r["id"], r["host"], r["port"], r["rank"]) for r in listed) == sorted(
        (e.replica_id, e.host, e.port, rank) for rank, e in by_rank.items()
    )


def test_a_killed_rank_brings_its_gang_back_with_every_rank_filled(stack: GangStack) -> None:
    before = ranks(stack)
    killed = before[1]
    actor = f"SERVE_REPLICA::{stack.app}#{killed.deployment}#{killed.replica_id}"
    ray.kill(ray.get_actor(actor, namespace="serve"), no_restart=True)

    def whole_again() -> bool:
        endpoints = asyncio.run(list_replica_endpoints(stack.app))
        return len(endpoints) == GANG_SIZE and killed.replica_id not in {e.replica_id for e in endpoints}

    wait_until(300, whole_again, "the gang to come back without the killed replica", poll_s=1)
    after = ranks(stack)
    assert sorted(after) == list(range(GANG_SIZE))
    assert killed.replica_id not in {e.replica_id for e in after.values()}
