"""kv_aware on real vLLM replicas of the tiny model (kv-aware-cpu.yaml, staging, two routers): the router's prompt
tokens are vLLM's own; each engine's KV events reach every router, and a repeated prefix goes to the replica that
caches it; two routers rank 100 requests alike; a replica that announces no publisher is approximated, and routers and
`sluice status` say so; a killed replica's blocks leave the index within a second and no decision names it after."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray

from base.contracts import FAULT_PATH, REPLICA_HEADER, REQUEST_ID_HEADER
from base.waiting import wait_until
from routers.kv_aware import KV_INDEX_PATH
from routers.prompt_tokens import PromptTokens
from services.internal_credential import internal_headers
from services.serve_internals import ReplicaEndpoint, list_replica_endpoints
from sluice.deploy.status import model_line, routers_report
from tests.support.engine_warmup import answer_once_on_every_replica
from tests.support.team_stack import TeamStack, team_stack

pytestmark = pytest.mark.integration

# Requests both routers rank, one router after the other.
RANKED_REQUESTS = 100
WORDS = "ka lo mi na te po su ri ve do ga hu".split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _chat(system: str, user: str, max_tokens: int = 2) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return {"model": "sluice-tiny", "messages": messages, "max_tokens": max_tokens}


@pytest.fixture(scope="module")
def stack(ray_cluster: None, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TeamStack]:
    folder = tmp_path_factory.mktemp("kv")
    with team_stack("kv-aware-cpu.yaml", "kv-test", folder, staging=True, routers=2) as deployed:
        yield deployed


def _endpoints(app: str) -> list[ReplicaEndpoint]:
    return asyncio.run(list_replica_endpoints(app))


def _indexes(stack: TeamStack) -> list[dict[str, Any]]:
    """Each router replica's KV index report."""
    app = stack.plan.models[0].router_app
    internal = internal_headers()
    return [httpx.get(f"{e.url}/{app}{KV_INDEX_PATH}", timeout=10, headers=internal).json() for e in _endpoints(app)]


def _route(
    router: ReplicaEndpoint, app: str, body: dict[str, Any], request_id: str, client: httpx.Client | None = None
) -> list[str]:
    """The router's ranking for the body; `client` keeps its connection open between calls."""
    post = client.post if client is not None else httpx.post
    reply = post(
        f"{router.url}/{app}/internal/route",
        content=json.dumps(body),
        headers={**internal_headers(), REQUEST_ID_HEADER: request_id},
    )
    reply.raise_for_status()
    return [reply.json()["replica_id"], *reply.json()["fallbacks"]]


def test_the_router_tokenizes_a_body_as_vllm_does(stack: TeamStack, tiny_model_dir: Path) -> None:
    tokens = PromptTokens(str(tiny_model_dir))
    replica = _endpoints(stack.plan.models[0].llm_app)[0]
    tokenize = f"{replica.url}/{stack.plan.models[0].llm_app}/tokenize"
    rng = random.Random(3)
    bodies = [
        _chat(_text(rng, 40), _text(rng, 9)),
        {"model": "sluice-tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "ka lo"}]}]},
        {
            "model": "sluice-tiny",
            "messages": [
                {"role": "user", "content": _text(rng, 5)},
                {"role": "assistant", "content": _text(rng, 7)},
                {"role": "user", "content": _text(rng, 3)},
            ],
        },
    ]
    for body in bodies:
        vllm = httpx.post(tokenize, json=body, timeout=30, headers=internal_headers())
        assert vllm.status_code == 200, vllm.text
        assert tokens(json.dumps(body).encode()) == vllm.json()["tokens"]
    completion = {"model": "sluice-tiny", "prompt": _text(rng, 30)}
    vllm = httpx.post(tokenize, json=completion, timeout=30, headers=internal_headers())
    assert tokens(json.dumps(completion).encode()) == vllm.json()["tokens"]


def test_a_repeated_prefix_goes_to_the_replica_that_caches_it(stack: TeamStack) -> None:
    rng = random.Random(5)
    system = _text(rng, 200)
    with httpx.Client(timeout=120) as client:
        first = client.post(f"{stack.url}/v1/chat/completions", json=_chat(system, _text(rng, 5)))
        assert first.status_code == 200, first.text
        holder = first.headers[REPLICA_HEADER]

        def every_router_indexed() -> bool:
            return all(index["replicas"].get(holder, {}).get("blocks", 0) >= 6 for index in _indexes(stack))

        wait_until(10, every_router_indexed, "both routers to index the first request's blocks", poll_s=0.1)
        served = []
        for _ in range(6):
            # Paced: at most two of them in a router's in-flight window, well below the saturation floor.
            time.sleep(1.0)
            reply = client.post(f"{stack.url}/v1/chat/completions", json=_chat(system, _text(rng, 5)))
            served.append(reply.headers[REPLICA_HEADER])
    assert served == [holder] * 6
    assert sum(index["decisions"].get("match", 0) for index in _indexes(stack)) >= 6


def _settled(stack: TeamStack) -> list[dict[str, Any]]:
    """The routers' reports once both hold the same blocks, unchanged for a second."""
    last: list[Any] = []

    def same_and_still() -> list[dict[str, Any]] | None:
        indexes = _indexes(stack)
        replicas = [index["replicas"] for index in indexes]
        steady = replicas[0] == replicas[1] and replicas == last
        last[:] = replicas
        return indexes if steady else None

    return wait_until(20, same_and_still, "both routers to hold the same index", poll_s=1.0)


def test_two_routers_rank_a_hundred_requests_alike(stack: TeamStack) -> None:
    app = stack.plan.models[0].router_app
    rng = random.Random(8)
    systems = [_text(rng, 120) for _ in range(4)]
    with httpx.Client(timeout=120) as client:
        for system in systems:
            assert client.post(f"{stack.url}/v1/chat/completions", json=_chat(system, "ka")).status_code == 200
    seconds = answer_once_on_every_replica(stack.plan.models[0].llm_app)
    _settled(stack)
    first, second = _endpoints(app)
    bodies = [_chat(rng.choice(systems) if i % 4 else _text(rng, 60), _text(rng, 6)) for i in range(RANKED_REQUESTS)]
    rankings: list[tuple[list[str], list[str]]] = []
    # A router counts its own placements for as long as a request takes on that engine: with that time gone between
    # two requests, each router ranks on the engines' reports and the index alone, which both routers share.
    gap_s = 2 * max(seconds) + 0.05
    with httpx.Client(timeout=30) as to_first, httpx.Client(timeout=30) as to_second:
        for i, body in enumerate(bodies):
            time.sleep(gap_s)
            rankings.append(
                (_route(first, app, body, f"same-{i}", to_first), _route(second, app, body, f"same-{i}", to_second))
            )
    differing = [(i, a, b) for i, (a, b) in enumerate(rankings) if a != b][:5]
    reports = [(index["replicas"], index["decisions"]) for index in _indexes(stack)]
    assert not differing, f"{differing}; gap {gap_s:.2f} s; routers {reports}"
    assert len({a[0] for a, _ in rankings}) >= 2, "every request on one replica: the scores were never compared"


def test_a_replica_without_events_is_scored_by_what_the_router_sent_it(stack: TeamStack) -> None:
    model = stack.plan.models[0]
    quiet = _endpoints(model.llm_app)[0]
    fault_url = f"{quiet.url}/{model.llm_app}{FAULT_PATH}"
    fault = httpx.post(fault_url, json={"kv_events": "off"}, timeout=10, headers=internal_headers())
    assert fault.status_code == 204, fault.text
    try:

        def approximated() -> bool:
            return all(i["replicas"][quiet.replica_id]["source"] == "approximate" for i in _indexes(stack))

        wait_until(15, approximated, "the routers to score the quiet replica by what they sent it", poll_s=0.2)
        router = _endpoints(model.router_app)[0]
        rng = random.Random(13)
        prefixes = [_text(rng, 100) for _ in range(20)]
        for round_ in range(2):
            for i, system in enumerate(prefixes):
                _route(router, model.router_app, _chat(system, "ka"), f"quiet-{round_}-{i}")
        index = httpx.get(f"{router.url}/{model.router_app}{KV_INDEX_PATH}", timeout=10, headers=internal_headers())
        decisions = index.json()["decisions"]
        assert decisions.get("approximate_match", 0) >= 1, decisions
        metrics = httpx.get(f"{router.url}/{model.router_app}/metrics", timeout=10).text
        assert f'sluice_router_kv_replicas{{app="{model.llm_app}",source="approximate"}} 1.0' in metrics
        with httpx.Client(timeout=120) as client:
            statuses = [
                client.post(f"{stack.url}/v1/chat/completions", json=_chat(system, "lo")).status_code
                for system in prefixes[:6]
            ]
        assert statuses == [200] * 6
        line = model_line(model, routers_report(model))
        assert f"{quiet.replica_id} approximate" in line, line
    finally:
        httpx.post(fault_url, json={"kv_events": "on"}, timeout=10, headers=internal_headers())


def test_a_killed_replica_leaves_the_index_within_a_second(stack: TeamStack) -> None:
    model = stack.plan.models[0]
    rng = random.Random(21)
    system = _text(rng, 200)
    with httpx.Client(timeout=120) as client:
        victim = client.post(f"{stack.url}/v1/chat/completions", json=_chat(system, "ka")).headers[REPLICA_HEADER]
    wait_until(10, lambda: all(i["replicas"][victim]["blocks"] > 0 for i in _indexes(stack)), "the index", poll_s=0.1)
    endpoint = next(e for e in _endpoints(model.llm_app) if e.replica_id == victim)
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{model.llm_app}#{endpoint.deployment}#{victim}", namespace="serve"))
    killed_at = time.monotonic()

    def gone() -> bool:
        return all(i["replicas"].get(victim, {"blocks": 0})["blocks"] == 0 for i in _indexes(stack))

    wait_until(5, gone, "the killed replica's blocks to leave every router's index", poll_s=0.05)
    left_after = time.monotonic() - killed_at
    print(f"the killed replica's blocks left the index {left_after * 1000:.0f} ms after the kill")
    assert left_after <= 1.0
    routers = _endpoints(model.router_app)
    primaries = {_route(routers[i % 2], model.router_app, _chat(system, "lo"), f"after-{i}")[0] for i in range(20)}
    assert victim not in primaries
