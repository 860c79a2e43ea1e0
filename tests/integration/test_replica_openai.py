"""The OpenAI contract of each real vLLM replica, called on the replica's own port."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from base import sse
from base.contracts import (
    INTERNAL_CREDENTIAL_HEADER,
    REASON_INTERNAL_CREDENTIAL,
    REPLICA_HEADER,
    REQUEST_ID_HEADER,
    SERVE_REASON_HEADER,
)
from loadtests.sse_timing import StreamRow, record_stream
from services.internal_credential import internal_headers
from sluice.deploy.check.items import WEATHER_SCHEMA, forced_tool_call
from tests.support.llm_cluster import LLMCluster
from tests.support.sse import chunks, data_lines, data_payloads, stream_lines

pytestmark = pytest.mark.integration

MODEL = "sluice-tiny"
# ignore_eos: random weights rarely emit EOS, but they may, and these tests assert a `length` finish.
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "route the stream"}],
    "max_tokens": 12,
    "ignore_eos": True,
}
COMPLETION = {"model": MODEL, "prompt": "ka lo mi", "max_tokens": 12, "ignore_eos": True}
WEATHER_TOOL_REQUEST = forced_tool_call(MODEL)


@pytest.fixture(scope="module", params=[0, 1], ids=["replica0", "replica1"])
def replica(request, llm_cluster: LLMCluster):
    return llm_cluster.endpoints[request.param]


def _assert_stamped(response: httpx.Response, replica_id: str) -> None:
    assert response.headers.get(REPLICA_HEADER) == replica_id
    assert response.headers.get(REQUEST_ID_HEADER)


def _running_requests(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics").text
    return sum(float(v) for v in re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", text, re.M))


def test_two_replicas_are_discoverable_on_their_own_ports(llm_cluster: LLMCluster) -> None:
    endpoints = llm_cluster.endpoints
    assert len({e.replica_id for e in endpoints}) == 2
    assert len({e.port for e in endpoints}) == 2
    for endpoint in endpoints:
        assert endpoint.host == "127.0.0.1"
        assert httpx.get(f"{endpoint.url}/-/healthz").status_code == 200


def test_a_request_without_the_internal_credential_is_refused_and_probes_need_none(replica) -> None:
    """A client that reached the replica's own port, past the frontend: 403 with its reason, whatever it asks (an
    engine request, the models list, a wrong or a doubled credential); the health probe and the metrics scrape
    answer without it, and the replica serves the next request that carries it."""
    wrong = {INTERNAL_CREDENTIAL_HEADER: "guessed"}
    doubled = [(INTERNAL_CREDENTIAL_HEADER, internal_headers()[INTERNAL_CREDENTIAL_HEADER])] * 2
    refused = [
        httpx.post(f"{replica.url}/v1/chat/completions", json=CHAT, timeout=30),
        httpx.post(f"{replica.url}/v1/completions", json=COMPLETION, headers=wrong, timeout=30),
        httpx.post(f"{replica.url}/v1/completions", json=COMPLETION, headers=doubled, timeout=30),
        httpx.get(f"{replica.url}/v1/models", timeout=30),
    ]
    for response in refused:
        assert response.status_code == 403, response.text
        assert response.headers[SERVE_REASON_HEADER] == REASON_INTERNAL_CREDENTIAL
        assert response.json()["error"]["code"] == 403
    assert httpx.get(f"{replica.url}/-/healthz").status_code == 200
    assert "vllm:num_requests_running" in httpx.get(f"{replica.url}/metrics").text
    served = httpx.post(f"{replica.url}/v1/completions", json=COMPLETION, headers=internal_headers(), timeout=30)
    assert served.status_code == 200, served.text


def test_models_and_metrics(replica) -> None:
    models = httpx.get(f"{replica.url}/v1/models", headers=internal_headers())
    assert models.status_code == 200
    assert [m["id"] for m in models.json()["data"]] == [MODEL]
    _assert_stamped(models, replica.replica_id)
    metrics = httpx.get(f"{replica.url}/metrics")
    assert metrics.status_code == 200
    assert "vllm:num_requests_running" in metrics.text


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_non_stream(replica, path: str, body: dict) -> None:
    response = httpx.post(f"{replica.url}{path}", json=body, timeout=30, headers=internal_headers())
    assert response.status_code == 200, response.text
    _assert_stamped(response, replica.replica_id)
    payload = response.json()
    assert payload["usage"]["completion_tokens"] == body["max_tokens"]
    assert payload["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_stream(replica, path: str, body: dict) -> None:
    stream = {**body, "stream": True}
    with httpx.stream("POST", f"{replica.url}{path}", json=stream, timeout=30, headers=internal_headers()) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        _assert_stamped(response, replica.replica_id)
        parsed = chunks(data_lines(response))
    assert parsed[-1]["choices"][0]["finish_reason"] == "length"


def test_request_id_is_echoed_and_generated(replica) -> None:
    internal = internal_headers()
    echoed = httpx.post(
        f"{replica.url}/v1/completions", json=COMPLETION, headers={**internal, "x-request-id": "team-a-42"}
    )
    assert echoed.headers.get_list(REQUEST_ID_HEADER) == ["team-a-42"]
    first = httpx.post(f"{replica.url}/v1/completions", json=COMPLETION, headers=internal)
    second = httpx.post(f"{replica.url}/v1/completions", json=COMPLETION, headers=internal)
    assert len(first.headers.get_list(REQUEST_ID_HEADER)) == 1
    assert first.headers[REQUEST_ID_HEADER] != second.headers[REQUEST_ID_HEADER]


def test_openai_client_streams_a_chat_completion(llm_cluster: LLMCluster) -> None:
    endpoint = llm_cluster.endpoints[0]
    client = openai.OpenAI(
        base_url=f"{endpoint.url}/v1", api_key="unused", max_retries=0, default_headers=internal_headers()
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    received = list(stream)
    assert received[0].choices[0].delta.role == "assistant"
    finishing = [c for c in received if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finishing] == ["length"]
    assert received[-1].choices == []
    assert received[-1].usage is not None and received[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in received[:-1])

    raw = httpx.post(
        f"{endpoint.url}/v1/chat/completions",
        json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
        headers=internal_headers(),
    )
    payloads = data_payloads(raw.content)
    parsed = chunks(payloads)
    assert parsed[-1]["usage"]["completion_tokens"] == CHAT["max_tokens"]


def test_forced_tool_call_non_stream(llm_cluster: LLMCluster) -> None:
    url = f"{llm_cluster.endpoints[0].url}/v1/chat/completions"
    response = httpx.post(url, json=WEATHER_TOOL_REQUEST, timeout=60, headers=internal_headers())
    assert response.status_code == 200, response.text
    calls = response.json()["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 1
    assert calls[0]["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), WEATHER_SCHEMA)


def test_forced_tool_call_stream(llm_cluster: LLMCluster) -> None:
    url = f"{llm_cluster.endpoints[1].url}/v1/chat/completions"
    body = {**WEATHER_TOOL_REQUEST, "stream": True}
    with httpx.stream("POST", url, json=body, timeout=60, headers=internal_headers()) as response:
        parsed = chunks(data_lines(response))
    deltas = [
        call for chunk in parsed for choice in chunk["choices"] for call in (choice["delta"].get("tool_calls") or [])
    ]
    assert deltas, "no tool-call deltas streamed"
    head, fragments = deltas[0], deltas[1:]
    assert head["id"] and head["function"]["name"] == "get_weather"
    assert fragments and all("id" not in d and "name" not in d["function"] for d in fragments)
    arguments = head["function"].get("arguments", "") + "".join(d["function"]["arguments"] for d in fragments)
    jsonschema.validate(json.loads(arguments), WEATHER_SCHEMA)


def test_a_generated_unicode_line_break_stays_inside_its_event(llm_cluster: LLMCluster, tiny_model_dir: Path) -> None:
    """vLLM's JSON leaves U+0085 raw; the tiny model generates it from its byte tokens C2 85 (sampling only those two
    makes it certain). sluice's line reader keeps each event whole, and a campaign's row reads every chunk, where
    `str.splitlines` (httpx's and requests' `iter_lines`) cuts such an event in two."""
    byte_tokens = AutoTokenizer.from_pretrained(tiny_model_dir).encode("\x85", add_special_tokens=False)
    assert len(byte_tokens) == 2
    body = {**COMPLETION, "max_tokens": 32, "stream": True, "seed": 7, "allowed_token_ids": byte_tokens}
    raw = httpx.post(
        f"{llm_cluster.endpoints[0].url}/v1/completions", json=body, timeout=30, headers=internal_headers()
    )
    text = "".join(chunk["choices"][0]["text"] for chunk in chunks(data_payloads(raw.content)) if chunk["choices"])
    assert "\x85" in text
    assert len(raw.text.splitlines()) > len(sse.lines(raw.content))

    row = StreamRow("unicode", "s", 0.0, 0.0)
    output = record_stream(
        row, raw.status_code, dict(raw.headers), 0.0, ((0.0, line) for line in sse.lines(raw.content))
    )
    assert (row.error, output.text) == ("", text)


def test_client_disconnect_aborts_the_engine_request(llm_cluster: LLMCluster) -> None:
    endpoint = llm_cluster.endpoints[0]
    body = {**COMPLETION, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    url = f"{endpoint.url}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=30, headers=internal_headers()) as response:
        lines = stream_lines(response)
        for _ in range(5):
            next(lines)
        assert _running_requests(endpoint.url) >= 1
    disconnected = time.monotonic()
    while _running_requests(endpoint.url) > 0:
        assert time.monotonic() - disconnected < 1.0, "engine still runs the request 1 s after the disconnect"
        time.sleep(0.02)


BAD_REQUESTS = {
    "malformed_json": b'{"model": "sluice-tiny", "messages": [',
    "wrong_types": {"model": MODEL, "messages": "hello", "max_tokens": "ten"},
    "negative_max_tokens": {**CHAT, "max_tokens": -5},
    "unknown_model": {**CHAT, "model": "gpt-imaginary"},
    "empty_messages": {**CHAT, "messages": []},
    "prompt_over_context": {**CHAT, "messages": [{"role": "user", "content": "ka lo mi " * 2000}]},
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_input_gets_an_openai_error_and_the_replica_keeps_serving(llm_cluster: LLMCluster, case: str) -> None:
    endpoint = llm_cluster.endpoints[0]
    bad = BAD_REQUESTS[case]
    if isinstance(bad, bytes):
        kwargs = {"content": bad, "headers": {**internal_headers(), "content-type": "application/json"}}
    else:
        kwargs = {"json": bad, "headers": internal_headers()}
    response = httpx.post(f"{endpoint.url}/v1/chat/completions", timeout=30, **kwargs)
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    error = response.json()["error"]
    assert error["message"] and error["type"] and error["code"] == response.status_code
    _assert_stamped(response, endpoint.replica_id)
    good = httpx.post(f"{endpoint.url}/v1/chat/completions", json=CHAT, timeout=30, headers=internal_headers())
    assert good.status_code == 200
