"""The replica's streaming Python method (the legacy ingress path) matches its HTTP port."""

from __future__ import annotations

import json

import httpx
import pytest
from ray import serve

from base.contracts import REPLICA_HEADER, REQUEST_ID_HEADER
from services.internal_credential import internal_headers
from services.replica.asgi_call import ResponseStart
from tests.support.llm_cluster import LLMCluster
from tests.support.sse import chunks, data_payloads

pytestmark = pytest.mark.integration

GREEDY_CHAT = {
    "model": "sluice-tiny",
    "messages": [{"role": "user", "content": "same answer twice"}],
    "max_tokens": 24,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}


def _payloads(body: bytes) -> list[str]:
    return data_payloads(body)


def _content(parsed: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in parsed if c["choices"])


def test_handle_stream_gives_the_same_sse_as_http(llm_cluster: LLMCluster) -> None:
    handle = serve.get_deployment_handle(llm_cluster.config.deployment.name, app_name=llm_cluster.app)
    body = json.dumps(GREEDY_CHAT).encode()
    items = list(
        handle.options(stream=True).stream.remote(
            "POST", "/v1/chat/completions", body, {"content-type": "application/json", "x-request-id": "via-handle"}
        )
    )
    start, chunk_bytes = items[0], items[1:]
    assert isinstance(start, ResponseStart)
    assert start.status == 200
    assert start.header("content-type").startswith("text/event-stream")
    assert start.header(REQUEST_ID_HEADER) == "via-handle"
    replica_ids = {e.replica_id for e in llm_cluster.endpoints}
    assert start.header(REPLICA_HEADER) in replica_ids
    assert len(chunk_bytes) > 2, "the handle path must stream chunk by chunk"
    via_handle = chunks(_payloads(b"".join(chunk_bytes)))

    endpoint = next(e for e in llm_cluster.endpoints if e.replica_id == start.header(REPLICA_HEADER))
    url = f"{endpoint.url}/v1/chat/completions"
    via_http = chunks(_payloads(httpx.post(url, json=GREEDY_CHAT, headers=internal_headers()).content))
    assert _content(via_handle) == _content(via_http) != ""
    # vLLM may merge tokens into fewer chunks when the reader lags, so compare the stream's shape, not its chunk count.
    for parsed in (via_handle, via_http):
        reasons = [c["choices"][0].get("finish_reason") for c in parsed if c["choices"]]
        assert reasons[-1] == "length"
        assert all(r is None for r in reasons[:-1])


def test_handle_stream_reports_bad_input_as_an_openai_error(llm_cluster: LLMCluster) -> None:
    handle = serve.get_deployment_handle(llm_cluster.config.deployment.name, app_name=llm_cluster.app)
    items = list(
        handle.options(stream=True).stream.remote(
            "POST", "/v1/chat/completions", b"{not json", {"content-type": "application/json"}
        )
    )
    assert items[0].status == 400
    assert json.loads(b"".join(items[1:]))["error"]["code"] == 400
