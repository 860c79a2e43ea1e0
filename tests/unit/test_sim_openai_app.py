"""The simulator's HTTP face (a benchmark stand-in): vLLM's OpenAI shapes, streamed and whole, the cached prompt
tokens in `usage`, vLLM's metric names, where it publishes KV events and its engine load, clear refusals, and the
stand-in named on every answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from base.contracts import ENGINE_LOAD_PATH, ENGINE_STAND_IN_HEADER, KV_EVENTS_PATH, REPLICA_HEADER, SIM_STAND_IN
from base.route_wire import EngineLoads, KVEventSource, KVEventSources
from routers.prompt_tokens import PromptTokens
from services.replica.sim.engine import SimEngine
from services.replica.sim.model import SimModel
from services.replica.sim.openai_app import SimOpenAIApp

SERVED = "sluice-tiny"
# Steps of a millisecond or less: the stand-in's timing is not under test here.
FAST = SimModel(step_overhead_s=0.0001, prefill_s_per_token=0.0, decode_base_s=0.0005, decode_s_per_seq=0.0)


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path):  # noqa: ANN201
    tokens = PromptTokens(str(tiny_model_dir))
    word = tokens.text_tokens(" token")[0]
    engine = SimEngine(FAST, output_token_ids=[word])
    source = KVEventSource(endpoint="tcp://127.0.0.1:1", replay_endpoint="tcp://127.0.0.1:2")
    app = SimOpenAIApp(engine, tokens, SERVED, "sim-07", source, {word: " token"}).app
    with TestClient(app) as test_client:
        yield test_client


def _chat(stream: bool, content: str) -> dict:
    body = {"model": SERVED, "messages": [{"role": "user", "content": content}], "max_tokens": 4, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def test_a_streamed_chat_comes_as_vllm_streams_it_and_a_repeat_says_its_cached_tokens(client: TestClient) -> None:
    prompt = " ".join(["replica"] * 80)
    events = []
    for _ in range(2):
        response = client.post("/v1/chat/completions", json=_chat(True, prompt))
        assert response.status_code == 200
        assert response.headers[ENGINE_STAND_IN_HEADER] == SIM_STAND_IN and response.headers[REPLICA_HEADER] == "sim-07"
        lines = [line for line in response.text.split("\n\n") if line]
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1]) == " token" * 4
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == 4 and usage["prompt_tokens"] > 80
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 64, "the second time its prompt's blocks were cached"


def test_a_whole_answer_and_the_metrics_and_announcements_a_router_reads(client: TestClient) -> None:
    answer = client.post("/v1/chat/completions", json=_chat(False, "hello there")).json()
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"] == " token" * 4
    metrics = client.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert f'{name}{{model_name="{SERVED}"}}' in metrics
    announced = KVEventSources.model_validate_json(client.get(KV_EVENTS_PATH).content)
    assert announced.block_size == FAST.block_size and announced.sources[0].replay_endpoint == "tcp://127.0.0.1:2"
    load = EngineLoads.model_validate_json(client.get(ENGINE_LOAD_PATH).content).ranks[0]
    assert load.running == 0 and load.kv_tokens_total == FAST.num_blocks * FAST.block_size
    assert load.prefix_cache_queries > 0
    assert load.request_seconds is not None and load.request_seconds > 0, "the finished requests' mean time"


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404),
        ({"model": SERVED, "prompt": "x"}, 400),
        ({"model": SERVED, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400),
        ({"model": SERVED, "messages": [{"role": "user", "content": "x " * 40_000}], "max_tokens": 4}, 400),
    ],
)
def test_what_it_cannot_serve_gets_an_openai_error(client: TestClient, body: dict, status: int) -> None:
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == status and response.json()["error"]["message"]
