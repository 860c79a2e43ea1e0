"""Capacity tokens on the direct path: the router takes one, HAProxy carries it, the replica releases it."""

from __future__ import annotations

import contextlib
import re

import httpx
import pytest
import ray

from base.contracts import CAPACITY_TOKEN_HEADER, REPLICA_HEADER
from base.waiting import WaitTimeout, wait_until
from routers.ledger_actor import ledger_actor_name
from sluice.bench.stack_harness import DirectStreamStack
from tests.support.llm_cluster import LLMCluster, direct_stack
from tests.support.sse import chunks, data_lines, stream_lines

pytestmark = pytest.mark.integration

STREAM = {"model": "sluice-tiny", "prompt": "ka lo", "max_tokens": 16, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def stack(llm_cluster: LLMCluster):
    with direct_stack(
        llm_cluster,
        router_name="llm-cq-router",
        policy="capacity_queue",
        check_inter_s=1.0,
    ) as started:
        yield started


@pytest.fixture(scope="module")
def ledger(stack, llm_cluster: LLMCluster):
    handle = ray.get_actor(ledger_actor_name(llm_cluster.app, llm_cluster.config.deployment.name), namespace="sluice")
    ray.get(handle.snapshot.remote(), timeout=120)
    return handle


def _settled(ledger, timeout_s: float = 1.0) -> dict:
    """The ledger once nothing is outstanding (or after timeout_s)."""
    with contextlib.suppress(WaitTimeout):
        wait_until(timeout_s, lambda: not ray.get(ledger.snapshot.remote())["outstanding"], "release", poll_s=0.05)
    return ray.get(ledger.snapshot.remote())


def _stream(stack: DirectStreamStack, headers: dict | None = None) -> list[dict]:
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=STREAM, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        return chunks(data_lines(response))


def test_a_finished_stream_releases_its_token_once(stack, ledger) -> None:
    _stream(stack)  # the first calls may meet a cold ledger actor; measure from a warm one
    before = _settled(ledger)
    for _ in range(5):
        assert _stream(stack)[-1]["choices"][0]["finish_reason"] == "length"
    after = _settled(ledger)
    assert after["granted"] - before["granted"] == 5
    assert after["released"] - before["released"] == 5
    assert after["outstanding"] == 0 and after["double_releases"] == before["double_releases"]


def test_a_client_disconnect_releases_the_token_and_aborts_the_engine(stack, ledger, llm_cluster) -> None:
    before = _settled(ledger)
    body = {**STREAM, "max_tokens": 1000, "ignore_eos": True}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=60) as response:
        lines = stream_lines(response)
        for _ in range(5):
            next(lines)
        assert ray.get(ledger.snapshot.remote())["outstanding"] == 1, "the stream must hold a token"
        replica = next(e for e in llm_cluster.endpoints if e.replica_id == response.headers[REPLICA_HEADER])
    after = _settled(ledger)
    assert after["outstanding"] == 0
    assert after["released"] - before["released"] == 1
    assert after["double_releases"] == before["double_releases"]
    text = httpx.get(f"{replica.url}/metrics").text
    assert sum(float(v) for v in re.findall(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M)) == 0


def test_a_client_cannot_forge_a_capacity_token(stack, ledger) -> None:
    before = _settled(ledger)
    _stream(stack, headers={CAPACITY_TOKEN_HEADER: "forged-token", "X-Sluice-Capacity-Token": "forged-2"})
    after = _settled(ledger)
    assert after["unknown_releases"] == before["unknown_releases"], "a forged token reached the ledger"
    assert after["released"] - before["released"] == 1
