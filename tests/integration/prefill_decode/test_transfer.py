"""Prefill/decode end to end on the package's stack (the prefill-decode-cpu team file, own name and ports, on the
session's Ray cluster, every request on the direct path): a real tiny vLLM prefill replica (KV producer) and decode
replica (KV consumer) joined by NIXL over host memory, a router choosing both, HAProxy pinning each request to the
decode replica.

The decode engine's own metrics prove the KV came over the wire: its prompt tokens are counted as
`external_kv_transfer` (none computed locally) and NIXL's byte count grows; decoding prompt B from prompt A's
transferred blocks continues A. The reference text is the same greedy request served by a replica of the plain
OpenAI topology (the session's tiny-model replicas). The prefill replica killed last: the decode replica prefills
locally (the team file opts in) and says so, and pairs again once Serve has replaced it.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray

from base.contracts import (
    PREFILL_BY_CALLER_HEADER,
    PREFILL_FALLBACK_HEADER,
    REASON_PREFILL_FAILED,
    REASON_PREFILL_UNROUTED,
    REPLICA_HEADER,
    SERVED_PREFILL_HEADER,
)
from base.waiting import wait_until
from builders.plan import StackPlan
from services.internal_credential import internal_headers
from services.replica.middleware.remote_prefill import REMOTE_DECODE_PARAMS
from services.serve_internals import ReplicaEndpoint, list_replica_endpoints
from tests.support.llm_cluster import LLMCluster
from tests.support.sse import chunks, data_lines, stream_lines
from tests.support.team_stack import TeamStack

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
PROMPT = "ka lo mi tessa ren do ka lo mi tessa ren do ka lo"


@dataclass
class PDStack:
    plan: StackPlan
    url: str
    model: str
    prefill_app: str
    decode_app: str
    spec_path: Path

    def endpoint(self, app: str) -> ReplicaEndpoint:
        [endpoint] = asyncio.run(list_replica_endpoints(app))
        return endpoint

    def app_url(self, app: str) -> str:
        """A replica's own port under its app's route prefix (bypassing the frontend)."""
        return f"{self.endpoint(app).url}/{app}"


@pytest.fixture(scope="module")
def stack(pd_stack: TeamStack) -> PDStack:
    pd_stack.shift(100, wait=True)  # every request on the direct path (the legacy module left it on the legacy path)
    [model] = pd_stack.plan.models
    assert model.prefill_app is not None
    return PDStack(pd_stack.plan, pd_stack.url, model.name, model.prefill_app, model.llm_app, pd_stack.path)


def metric(app_url: str, name: str, **labels: str) -> float:
    """The sum of a vLLM metric's samples on one replica whose labels include `labels`."""
    text = httpx.get(f"{app_url}/metrics", timeout=10).text
    total = 0.0
    for sample_labels, value in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        if all(f'{k}="{v}"' in sample_labels for k, v in labels.items()):
            total += float(value)
    return total


def transfer_evidence(app_url: str) -> tuple[float, float, float]:
    """(prompt tokens from KV transfer, prompt tokens computed here, NIXL bytes received) on a decode replica."""
    return (
        metric(app_url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"),
        metric(app_url, "vllm:prompt_tokens_by_source_total", source="local_compute"),
        metric(app_url, "vllm:nixl_bytes_transferred_sum"),
    )


def chat(model: str, content: str = PROMPT, max_tokens: int = 16, stream: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def stream_chat(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[httpx.Headers, str, int]:
    """(response headers, text, prompt tokens) of a streamed chat."""
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        events = chunks(data_lines(response))
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    return response.headers, text, events[-1]["usage"]["prompt_tokens"]


def text_of(client: httpx.Client, url: str, body: dict[str, Any]) -> str:
    response = client.post(url, json={**body, "stream": False})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def whole(client: httpx.Client, stack: PDStack, path: str, body: dict[str, Any]) -> str:
    """The request served whole by one engine of the stack (the prefill replica, no transfer asked)."""
    return text_of(client, f"{stack.app_url(stack.prefill_app)}{path}", body)


def openai_topology(client: httpx.Client, llm_cluster: LLMCluster, path: str, body: dict[str, Any]) -> str:
    """The reference: the same request served by a replica of the plain OpenAI topology (its own served name)."""
    return text_of(client, f"{llm_cluster.endpoints[0].url}{path}", {k: v for k, v in body.items() if k != "model"})


def test_a_streamed_chat_is_prefilled_there_and_decoded_here_from_the_transferred_kv(
    stack: PDStack, llm_cluster: LLMCluster
) -> None:
    decode_url = stack.app_url(stack.decode_app)
    before = transfer_evidence(decode_url)
    with httpx.Client(timeout=60, headers=internal_headers()) as client:
        headers, text, prompt_tokens = stream_chat(client, stack.url, chat(stack.model))
        reference = openai_topology(client, llm_cluster, "/v1/chat/completions", chat(stack.model, stream=False))
    after = transfer_evidence(decode_url)
    assert headers[REPLICA_HEADER] == stack.endpoint(stack.decode_app).replica_id
    assert headers[SERVED_PREFILL_HEADER] == stack.endpoint(stack.prefill_app).replica_id
    assert PREFILL_FALLBACK_HEADER not in headers
    external, local, nixl_bytes = (a - b for a, b in zip(after, before, strict=True))
    assert (external, local) == (prompt_tokens, 0)
    assert nixl_bytes > 0
    assert text == reference and text


def test_a_non_streamed_completion_names_both_replicas_and_equals_one_engines_text(
    stack: PDStack, llm_cluster: LLMCluster
) -> None:
    body = {"model": stack.model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    with httpx.Client(timeout=60, headers=internal_headers()) as client:
        response = client.post(f"{stack.url}/v1/completions", json=body)
        reference = openai_topology(client, llm_cluster, "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert response.headers[REPLICA_HEADER] == stack.endpoint(stack.decode_app).replica_id
    assert response.headers[SERVED_PREFILL_HEADER] == stack.endpoint(stack.prefill_app).replica_id
    assert response.json()["choices"][0]["text"] == reference


def test_decoding_prompt_b_from_prompt_as_blocks_continues_a(stack: PDStack) -> None:
    """The decode engine really reads the transferred KV: given A's blocks, it continues A, whatever B says.
    Prompts of token ids of the same length (the blocks must cover B's prompt) and the same last token (decode
    computes the last position itself), different everywhere else."""
    a = {"model": stack.model, "prompt": [*range(100, 115), 50], "max_tokens": 12, "temperature": 0}
    b = {**a, "prompt": [*range(300, 315), 50]}
    with httpx.Client(timeout=60, headers=internal_headers()) as client:
        text_a, text_b = whole(client, stack, "/v1/completions", a), whole(client, stack, "/v1/completions", b)
        prefill = client.post(
            f"{stack.app_url(stack.prefill_app)}/v1/completions",
            json={**a, "max_tokens": 1, "kv_transfer_params": REMOTE_DECODE_PARAMS},
        )
        assert prefill.status_code == 200, prefill.text
        # Without A's token ids, which vLLM would otherwise decode instead of B's.
        params = {k: v for k, v in prefill.json()["kv_transfer_params"].items() if k != "prompt_token_ids"}
        crossed = client.post(
            f"{stack.app_url(stack.decode_app)}/v1/completions",
            json={**b, "kv_transfer_params": params},
            headers={PREFILL_BY_CALLER_HEADER: "1"},
        )
    assert crossed.status_code == 200, crossed.text
    assert text_a != text_b, "the check needs prompts that continue differently"
    assert crossed.json()["choices"][0]["text"] == text_a, (text_a, text_b)


def test_twenty_concurrent_streams_all_complete_through_both_replicas(stack: PDStack) -> None:
    prefill_id = stack.endpoint(stack.prefill_app).replica_id

    def one(i: int) -> tuple[str | None, str | None, str]:
        with httpx.Client(timeout=120) as client:
            headers, text, _ = stream_chat(client, stack.url, chat(stack.model, f"{PROMPT} {i}", max_tokens=24))
        return headers.get(SERVED_PREFILL_HEADER), headers.get(PREFILL_FALLBACK_HEADER), text

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(20)))
    assert [(served, fallback) for served, fallback, _ in results] == [(prefill_id, None)] * 20
    assert all(text for _, _, text in results)


def test_status_shows_each_apps_role_and_which_pairs_served(stack: PDStack) -> None:
    address = ray.get_runtime_context().gcs_address
    result = subprocess.run(
        [sys.executable, "-m", "sluice.cli.main", "status", str(stack.spec_path), "--address", address, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    report = json.loads(result.stdout)
    assert report["state"] == "ready", report["state"]
    assert report["apps"][stack.prefill_app]["role"].startswith("prefill replicas")
    assert report["apps"][stack.decode_app]["role"].startswith("decode replicas")
    decode, prefill = stack.endpoint(stack.decode_app).replica_id, stack.endpoint(stack.prefill_app).replica_id
    remote = [p for p in report["pairs"][stack.model] if p["outcome"] == "remote"]
    # Every request so far, on either path (the 20 concurrent streams among them), was served by this one pair.
    assert [(p["decode"], p["prefill"]) for p in remote] == [(decode, prefill)] and remote[0]["requests"] >= 20


def in_flight(app_url: str) -> float:
    """Requests an engine runs or holds waiting (a decode request waits while its KV comes over)."""
    return metric(app_url, "vllm:num_requests_running") + metric(app_url, "vllm:num_requests_waiting")


def test_a_client_disconnect_mid_decode_leaves_no_request_running_on_either_engine(stack: PDStack) -> None:
    urls = [stack.app_url(stack.prefill_app), stack.app_url(stack.decode_app)]
    body = {**chat(stack.model, max_tokens=1000), "ignore_eos": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{stack.url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = stream_lines(response)
            for _ in range(5):
                next(lines)
            assert in_flight(urls[1]) >= 1
        closed = time.monotonic()
    while any(in_flight(url) for url in urls):
        assert time.monotonic() - closed < 1.0, [in_flight(url) for url in urls]
        time.sleep(0.05)


def test_with_the_prefill_replica_killed_decode_prefills_locally_then_pairs_again(stack: PDStack) -> None:
    killed = stack.endpoint(stack.prefill_app)
    actor = ray.get_actor(
        f"SERVE_REPLICA::{stack.prefill_app}#{killed.deployment}#{killed.replica_id}", namespace="serve"
    )
    ray.kill(actor, no_restart=True)
    reasons = set()
    with httpx.Client(timeout=60) as client:
        # Until Serve drops it from the list the router still pairs with it (the call fails); after, with none.
        for _ in range(6):
            headers, text, _ = stream_chat(client, stack.url, chat(stack.model, max_tokens=4))
            assert text and headers[SERVED_PREFILL_HEADER] == headers[REPLICA_HEADER]
            reasons.add(headers[PREFILL_FALLBACK_HEADER])
            time.sleep(0.5)
        assert reasons <= {REASON_PREFILL_FAILED, REASON_PREFILL_UNROUTED} and reasons

        def replaced() -> list | None:
            endpoints = asyncio.run(list_replica_endpoints(stack.prefill_app))
            return endpoints if endpoints and endpoints[0].replica_id != killed.replica_id else None

        endpoints = wait_until(240, replaced, "the prefill replica to be replaced", poll_s=1)
        time.sleep(1)  # the router's next poll
        headers, _, _ = stream_chat(client, stack.url, chat(stack.model, max_tokens=4))
    assert headers[SERVED_PREFILL_HEADER] == endpoints[0].replica_id and PREFILL_FALLBACK_HEADER not in headers
