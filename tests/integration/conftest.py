"""One local Ray + Serve with two tiny-model replicas for the whole integration session."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from base.tracing import Tracing
from base.waiting import WaitTimeout, wait_until
from services.replica.llm_config import ReplicaDeploymentConfig
from services.serve_internals import wait_for_endpoints
from sluice.deploy.local_cluster import start_local_cluster, stop_local_cluster
from tests.support.frontend_contract import checking_frontend_responses
from tests.support.llm_cluster import LLM_APP, LLMCluster, deploy_llm_app
from tests.support.otlp_receiver import OTLPReceiver, otlp_receiver
from tests.support.ports import free_port


def _assert_no_process_left(timeout_s: float = 20.0) -> None:
    """Every Ray worker and vLLM engine this session started must be gone after shutdown."""
    with contextlib.suppress(WaitTimeout):
        wait_until(timeout_s, lambda: not psutil.Process().children(recursive=True), "no child process", poll_s=0.5)
    left = psutil.Process().children(recursive=True)
    for process in left:
        process.kill()
    assert not left, f"processes left behind: {[p.pid for p in left]}"


@pytest.fixture(scope="session", autouse=True)
def frontend_responses_follow_the_error_contract() -> Iterator[None]:
    """Every response from a sluice frontend, in every integration test: a 5xx carries `x-serve-reason`."""
    with checking_frontend_responses():
        yield


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A local Ray + Serve on 127.0.0.1; at the end, no process it started may survive."""
    start_local_cluster(serve_proxy_port=free_port())
    try:
        yield
    finally:
        stop_local_cluster()
        _assert_no_process_left()


@pytest.fixture(scope="session")
def otlp_traces() -> Iterator[OTLPReceiver]:
    """The session's trace receiver (OTLP/gRPC on loopback), which the session's replicas send their spans to."""
    with otlp_receiver() as receiver:
        yield receiver


@pytest.fixture(scope="session")
def llm_cluster(otlp_traces: OTLPReceiver, ray_cluster: None, tiny_model_dir: Path) -> LLMCluster:
    # capacity_ledger: the replicas release capacity tokens a capacity_queue router hands out. Tracing at ratio 0:
    # only a request that comes with a sampled traceparent is traced (test_tracing.py); the receiver outlives them.
    tracing = Tracing(otlp_endpoint=otlp_traces.endpoint, sample_ratio=0.0)
    deployment = ReplicaDeploymentConfig(num_replicas=2, capacity_ledger=True)
    config = deploy_llm_app(LLM_APP, tiny_model_dir, deployment, tracing=tracing)
    endpoints = wait_for_endpoints(LLM_APP, 2, timeout_s=300)
    return LLMCluster(app=LLM_APP, config=config, endpoints=endpoints)
