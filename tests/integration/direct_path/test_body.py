"""A body-forwarding app end to end: real HAProxy -> real router (consistent hash keyed on the body's `user`)
-> real vLLM replicas, with bodies larger than HAProxy's forwarding buffer."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from base.contracts import REPLICA_HEADER, SERVE_FALLBACK_HEADER, SERVE_REASON_HEADER
from services.serve_internals import list_replica_endpoints
from sluice.bench.stack_harness import DirectStreamStack
from tests.support.llm_cluster import LLMCluster, direct_stack

pytestmark = pytest.mark.integration

BUFFER_BYTES = 1024
# 400 token ids: a ~2.4 KB body (past the buffer) that stays well inside the tiny model's context.
LONG_PROMPT = list(range(100, 500))


def _completion(user: str, user_first: bool) -> dict:
    """A completion whose `user` comes before the prompt (inside the forwarded prefix) or after it (cut off)."""
    fields: dict = {"model": "sluice-tiny", "max_tokens": 2}
    if user_first:
        return {**fields, "user": user, "prompt": LONG_PROMPT}
    return {**fields, "prompt": LONG_PROMPT, "user": user}


@pytest.fixture(scope="module")
def stack(llm_cluster: LLMCluster):
    with direct_stack(
        llm_cluster,
        router_name=f"{llm_cluster.app}-body-router",
        routers=1,
        policy="consistent_hash",
        policy_kwargs={"user_affinity": True},
        forward_body=True,
        body_buffer_bytes=BUFFER_BYTES,
    ) as started:
        yield started


def _truncated_bodies(stack: DirectStreamStack) -> float:
    """The router's count of route calls whose body HAProxy cut (X-Body-Truncated)."""
    (router,) = asyncio.run(list_replica_endpoints(stack.spec.router_app))
    text = httpx.get(f"{router.url}{stack.spec.router_route_prefix}/metrics").text
    pattern = rf'^sluice_router_truncated_bodies_total\{{app="{re.escape(stack.spec.app)}"\}} (\S+)$'
    match = re.search(pattern, text, re.M)
    return float(match.group(1)) if match else 0.0


def _served_by(client: httpx.Client, stack: DirectStreamStack, body: dict | bytes) -> str:
    content = body if isinstance(body, bytes) else None
    response = client.post(
        f"{stack.url}/v1/completions",
        json=None if content else body,
        content=content,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 200, (response.status_code, response.headers, response.text[:300])
    assert SERVE_REASON_HEADER not in response.headers and SERVE_FALLBACK_HEADER not in response.headers
    return response.headers[REPLICA_HEADER]


def test_a_cut_body_is_routed_and_the_user_in_its_prefix_keeps_its_replica(stack: DirectStreamStack) -> None:
    before = _truncated_bodies(stack)
    with httpx.Client(timeout=60) as client:
        for user in ("alice", "bob", "carol", "dave"):
            replicas = {_served_by(client, stack, _completion(user, user_first=True)) for _ in range(5)}
            assert len(replicas) == 1, f"{user} moved between replicas: {replicas}"
    assert _truncated_bodies(stack) == before + 20, "the router never saw X-Body-Truncated"


def test_a_user_past_the_cut_does_not_fail_the_route_and_requests_spread(stack: DirectStreamStack) -> None:
    before = _truncated_bodies(stack)
    with httpx.Client(timeout=60) as client:
        replicas = {_served_by(client, stack, _completion("alice", user_first=False)) for _ in range(20)}
    assert len(replicas) == 2, "without a readable user each request is keyed by its own id"
    assert _truncated_bodies(stack) == before + 20


def test_invalid_json_past_the_buffer_is_routed_and_answered_by_vllm(stack: DirectStreamStack) -> None:
    body = b'{"model": "sluice-tiny", "user": "alice", "prompt": [' + b"1, " * 1000
    response = httpx.post(
        f"{stack.url}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60
    )
    assert response.status_code == 400, "vLLM, not the data plane, rejects the bad body"
    assert SERVE_REASON_HEADER not in response.headers
    assert response.json()["error"]["code"] == 400
    assert response.headers[REPLICA_HEADER]
