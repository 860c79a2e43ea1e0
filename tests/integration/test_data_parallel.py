"""In-engine data parallelism end to end: the data-parallel-cpu team file (own name and ports) deployed from its plan
onto the session's Ray cluster: two real tiny vLLM replicas, each one server with two engine ranks (vLLM's DP
coordinator, each engine core on its own CPU). The router ranks every (replica, rank) pair; HAProxy pins the
request to the replica and names the rank in `x-data-parallel-rank`, which vLLM honours. vLLM's per-engine
metrics (`engine` label) say which engine served."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from base.contracts import DATA_PARALLEL_RANK_HEADER, REPLICA_HEADER, SERVED_RANK_HEADER, SESSION_HEADER_DEFAULT
from builders.plan import StackPlan
from services.internal_credential import internal_headers
from services.serve_internals import ReplicaEndpoint, list_replica_endpoints
from tests.support.llm_cluster import LLMCluster
from tests.support.team_stack import team_stack

pytestmark = pytest.mark.integration

RANKS = 2
_SUCCESS = re.compile(r"^vllm:request_success_total\{([^}]*)\} (\S+)$", re.M)
_ENGINE = re.compile(r'engine="(\d+)"')


@dataclass
class DPStack:
    plan: StackPlan
    url: str
    model: str
    app: str
    replicas: list[ReplicaEndpoint]


@pytest.fixture(scope="module")
def stack(ray_cluster: None, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DPStack]:
    with team_stack("data-parallel-cpu.yaml", "dp-test", tmp_path_factory.mktemp("data-parallel")) as deployed:
        [model] = deployed.plan.models
        assert model.data_parallel == "in_engine" and model.data_parallel_size == RANKS
        replicas = asyncio.run(list_replica_endpoints(model.llm_app))
        yield DPStack(deployed.plan, deployed.url, model.name, model.llm_app, replicas)


def served_per_engine(stack: DPStack) -> Counter[tuple[str, str]]:
    """Finished requests per (replica, engine rank), from each replica's vLLM metrics."""
    counts: Counter[tuple[str, str]] = Counter()
    for replica in stack.replicas:
        text = httpx.get(f"{replica.url}/{stack.app}/metrics", timeout=10).text
        for labels, value in _SUCCESS.findall(text):
            engine = _ENGINE.search(labels)
            assert engine is not None, labels
            counts[(replica.replica_id, engine.group(1))] += int(float(value))
    return counts


def completion(stack: DPStack, client: httpx.Client, headers: dict[str, str] | None = None) -> tuple[str, str]:
    """(replica, engine rank) that served one short completion through the frontend."""
    body = {"model": stack.model, "prompt": "ka lo mi", "max_tokens": 2}
    response = client.post(f"{stack.url}/v1/completions", json=body, headers=headers or {})
    assert response.status_code == 200, response.text
    return response.headers[REPLICA_HEADER], response.headers[SERVED_RANK_HEADER]


def test_requests_reach_every_replica_rank_pair_as_the_engines_count_them(stack: DPStack) -> None:
    before = served_per_engine(stack)
    with httpx.Client(timeout=60) as client:
        served = Counter(completion(stack, client) for _ in range(200))
    counted = served_per_engine(stack)
    counted.subtract(before)
    pairs = {(r.replica_id, str(rank)) for r in stack.replicas for rank in range(RANKS)}
    assert set(served) == pairs, served
    # What the responses say equals what each engine counted.
    assert {pair: counted[pair] for pair in pairs} == dict(served)


def test_a_session_stays_on_one_pair(stack: DPStack) -> None:
    with httpx.Client(timeout=60) as client:
        per_session = {
            session: {completion(stack, client, {SESSION_HEADER_DEFAULT: session}) for _ in range(5)}
            for session in (f"user-{i}" for i in range(12))
        }
    assert all(len(pairs) == 1 for pairs in per_session.values()), per_session
    assert len(set.union(*per_session.values())) > 1


def test_a_client_cannot_pick_the_engine_rank(stack: DPStack) -> None:
    session = {SESSION_HEADER_DEFAULT: "rank-picker"}
    with httpx.Client(timeout=60) as client:
        chosen = completion(stack, client, session)
        forged_rank = str(1 - int(chosen[1]))
        assert {completion(stack, client, {**session, DATA_PARALLEL_RANK_HEADER: forged_rank}) for _ in range(5)} == {
            chosen
        }


def test_every_engine_rank_answers_like_a_single_engine(stack: DPStack, llm_cluster: LLMCluster) -> None:
    body = {"prompt": "ka lo mi tessa", "max_tokens": 16, "temperature": 0}
    with httpx.Client(timeout=60, headers=internal_headers()) as client:
        single = client.post(f"{llm_cluster.endpoints[0].url}/v1/completions", json=body).json()
        texts = set()
        for replica in stack.replicas:
            for rank in range(RANKS):
                response = client.post(
                    f"{replica.url}/{stack.app}/v1/completions",
                    json={**body, "model": stack.model},
                    headers={DATA_PARALLEL_RANK_HEADER: str(rank)},
                )
                assert response.status_code == 200, response.text
                texts.add(response.json()["choices"][0]["text"])
    assert texts == {single["choices"][0]["text"]}
