"""Two models behind one frontend, end to end: the two-models-cpu team file (own name and ports) deployed from its
plan onto the session's Ray cluster, real tiny vLLM replicas under two served names, each with its own router and
policy. Every request is served by a replica of the model it named; what names no served model is refused."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from base.contracts import (
    MODEL_HEADER,
    MODELS_PATH,
    REASON_MODEL_BEYOND_BUFFER,
    REASON_MODEL_NOT_FOUND,
    REPLICA_HEADER,
    SERVE_REASON_HEADER,
)
from builders.plan import StackPlan
from services.serve_internals import list_replica_endpoints
from tests.support.sse import chunks, data_lines
from tests.support.team_stack import team_stack

pytestmark = pytest.mark.integration


@dataclass
class TwoModelStack:
    plan: StackPlan
    url: str
    body_buffer_bytes: int
    # Served model name -> the replica ids of its LLM app.
    replicas: dict[str, set[str]]


@pytest.fixture(scope="module")
def stack(ray_cluster: None, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoModelStack]:
    with team_stack("two-models-cpu.yaml", "two-models-test", tmp_path_factory.mktemp("two-models")) as deployed:
        plan = deployed.plan
        replicas = {
            model.name: {e.replica_id for e in asyncio.run(list_replica_endpoints(model.llm_app))}
            for model in plan.models
        }
        assert all(replicas.values()) and not set.intersection(*replicas.values())
        yield TwoModelStack(plan, deployed.url, deployed.spec.routing.body_buffer_bytes, replicas)


def _stream(client: httpx.Client, url: str, body: dict, headers: dict | None = None) -> tuple[str, list[dict]]:
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers or {}) as response:
        assert response.status_code == 200, response.read()
        return response.headers[REPLICA_HEADER], chunks(data_lines(response))


def _chat(model: str | None, content: str = "ka lo") -> dict:
    body: dict = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "stream": True}
    if model is not None:
        body["model"] = model  # after `messages`, as OpenAI clients send it
    return body


def test_requests_alternating_models_are_each_served_by_a_replica_of_their_model(stack: TwoModelStack) -> None:
    names = [model.name for model in stack.plan.models]
    served = {name: 0 for name in names}
    with httpx.Client(timeout=60) as client:
        for i in range(100):
            model = names[i % 2]
            replica, events = _stream(client, stack.url, _chat(model))
            assert replica in stack.replicas[model], (model, replica)
            # vLLM answers under the model's served name: the request reached that model's engine.
            assert {event["model"] for event in events} == {model}
            served[model] += 1
    assert served == {name: 50 for name in names}


def test_the_model_header_picks_the_model_when_the_body_names_none(stack: TwoModelStack) -> None:
    for model in reversed(stack.plan.models):
        with httpx.Client(timeout=60) as client:
            replica, events = _stream(client, stack.url, _chat(None), headers={MODEL_HEADER: model.name})
        assert replica in stack.replicas[model.name] and events[0]["model"] == model.name


def test_an_unknown_model_gets_404_naming_both(stack: TwoModelStack) -> None:
    with httpx.Client(timeout=30) as client:
        response = client.post(f"{stack.url}/v1/chat/completions", json=_chat("gpt-4o"))
    assert response.status_code == 404 and response.headers[SERVE_REASON_HEADER] == REASON_MODEL_NOT_FOUND
    message = response.json()["error"]["message"]
    assert "gpt-4o" in message and all(model.name in message for model in stack.plan.models)


def test_models_lists_both(stack: TwoModelStack) -> None:
    with httpx.Client(timeout=30) as client:
        response = client.get(f"{stack.url}{MODELS_PATH}")
    assert response.status_code == 200
    assert [m["id"] for m in response.json()["data"]] == [model.name for model in stack.plan.models]


def test_a_model_beyond_the_body_buffer_gets_a_4xx_naming_the_limit(stack: TwoModelStack) -> None:
    code = stack.plan.models[1].name
    body = _chat(code, content="ka " * stack.body_buffer_bytes)
    with httpx.Client(timeout=30) as client:
        response = client.post(f"{stack.url}/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.headers[SERVE_REASON_HEADER] == REASON_MODEL_BEYOND_BUFFER
    assert str(stack.body_buffer_bytes) in response.json()["error"]["message"]
    assert REPLICA_HEADER not in response.headers
