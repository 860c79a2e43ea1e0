"""A team file with `engine: sim` (sim-kv-aware.yaml, two replicas here) deployed as any other: Serve replicas run the
simulator engine stand-in instead of vLLM, every answer names it, the router follows its KV events and its engine
load (kv_aware on token load), a repeated conversation goes where its prefix is cached, and the shadow policies are
scored and reported by the router and `sluice status`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ray import serve

from base.contracts import ENGINE_STAND_IN_HEADER, REPLICA_HEADER, SIM_STAND_IN
from base.waiting import wait_until
from routers.shadows import SHADOWS_KEY
from services.router.engine_load_poller import ENGINE_LOAD_POLL_S
from sluice.deploy.status import model_line
from tests.support.engine_warmup import answer_once_on_every_replica
from tests.support.team_stack import TeamStack, team_stack

pytestmark = pytest.mark.integration

CONVERSATION = " ".join(["stream ring queue data plane replica serve hash token route"] * 30)


@pytest.fixture(scope="module")
def stack(ray_cluster: None, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TeamStack]:
    folder = tmp_path_factory.mktemp("sim")
    with team_stack("sim-kv-aware.yaml", "sim-test", folder, models={"replicas": 2}) as deployed:
        yield deployed


def _chat(stack: TeamStack, content: str) -> httpx.Response:
    body = {
        "model": "sluice-tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30)


def _described(stack: TeamStack) -> dict[str, Any]:
    return serve.get_app_handle(stack.plan.models[0].router_app).describe.remote().result(timeout_s=10)


def test_a_simulated_stack_answers_as_vllm_would_and_keeps_a_conversation_where_its_prefix_is(
    stack: TeamStack,
) -> None:
    # The router learns each engine's load within its poll and each replica's events within its announcement.
    wait_until(
        30,
        lambda: all(r["source"] == "events" for r in _described(stack)["kv_events"]["replicas"].values()),
        "the router to follow both replicas' KV events",
        poll_s=0.5,
    )
    # Each engine answers once, so it reports its time per request: the router then counts each request it places
    # for that long, and a client's requests one after another are not taken as open at once.
    answer_once_on_every_replica(stack.plan.models[0].llm_app)
    time.sleep(2 * ENGINE_LOAD_POLL_S + 0.1)
    first = _chat(stack, CONVERSATION)
    assert first.status_code == 200 and first.headers[ENGINE_STAND_IN_HEADER] == SIM_STAND_IN
    assert first.text.rstrip().endswith("data: [DONE]")
    replicas = set()
    for _ in range(4):
        again = _chat(stack, CONVERSATION)
        assert again.status_code == 200
        replicas.add(again.headers[REPLICA_HEADER])
        assert '"cached_tokens":0' not in again.text, "the prompt's blocks were cached where it went"
    assert replicas == {first.headers[REPLICA_HEADER]}, "every repeat went where the prefix was cached"
    decisions = _described(stack)["kv_events"]["decisions"]
    assert decisions.get("match", 0) >= 4, decisions


def test_the_shadow_policies_are_scored_and_sluice_status_shows_them(stack: TeamStack) -> None:
    for index in range(6):
        assert _chat(stack, f"{CONVERSATION} {index}").status_code == 200
    report = _described(stack)[SHADOWS_KEY]
    assert report["live"] == "kv_aware" and report["shadows"] == ["round_robin", "consistent_hash"]
    assert all(report["predicted_hit"][name] is not None for name in ("kv_aware", "round_robin", "consistent_hash"))
    assert report["predicted_hit"]["kv_aware"] > 0.5, report
    wait_until(
        10, lambda: _described(stack)[SHADOWS_KEY]["engine_hit"] is not None, "the engines' hit ratio", poll_s=0.5
    )
    line = model_line(stack.plan.models[0], _described(stack))
    assert "live kv_aware: predicted hit" in line and "shadow consistent_hash" in line, line


def test_the_models_list_comes_from_the_simulator_not_vllm(stack: TeamStack) -> None:
    models = httpx.get(f"{stack.url}/v1/models", timeout=10)
    assert models.status_code == 200 and models.json()["data"][0]["owned_by"] == "sluice-sim"
