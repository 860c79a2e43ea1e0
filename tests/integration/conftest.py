"""One local Ray + Serve with two tiny-model replicas for the whole integration session."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from services.replica.llm_config import EngineConfig, LLMAppConfig, ReplicaDeploymentConfig
from services.serve_internals import ReplicaEndpoint, wait_for_endpoints
from sluice.bench.stack_harness import DirectStreamSpec, DirectStreamStack
from sluice.deploy.local_cluster import start_local_cluster, stop_local_cluster
from tests.support.frontend_contract import checking_frontend_responses, register_frontend

LLM_APP = "llm"


@dataclass
class LLMCluster:
    app: str
    config: LLMAppConfig
    endpoints: list[ReplicaEndpoint]


# Ray's workers take ports 10002-19999, Serve's replicas 30000-31000 and the kernel hands out
# ephemeral ports from 32768: a port the tests pick here is one none of them will grab meanwhile.
_TEST_PORTS = range(20000, 30000)


def free_port() -> int:
    for port in random.sample(_TEST_PORTS, 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free test port between 20000 and 29999")


def _assert_no_process_left(timeout_s: float = 20.0) -> None:
    """Every Ray worker and vLLM engine this session started must be gone after shutdown."""
    deadline = time.monotonic() + timeout_s
    while (left := psutil.Process().children(recursive=True)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for process in left:
        process.kill()
    assert not left, f"processes left behind: {[p.pid for p in left]}"


def deploy_llm_app(
    name: str, model: Path, deployment: ReplicaDeploymentConfig, route_prefix: str = "/", **engine: Any
) -> LLMAppConfig:
    """Deploy an LLM app; its replicas serve `route_prefix` + vLLM's paths on their own ports. `engine`: further
    `EngineConfig` fields."""
    from ray import serve

    from services.replica.llm_replica import llm_application

    config = LLMAppConfig(engine=EngineConfig(model=str(model), **engine), deployment=deployment)
    serve.run(llm_application(config), name=name, route_prefix=route_prefix, blocking=False)
    return config


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
def llm_cluster(ray_cluster: None, tiny_model_dir: Path) -> LLMCluster:
    # capacity_ledger: the replicas release capacity tokens a capacity_queue router hands out.
    config = deploy_llm_app(LLM_APP, tiny_model_dir, ReplicaDeploymentConfig(num_replicas=2, capacity_ledger=True))
    endpoints = wait_for_endpoints(LLM_APP, 2, timeout_s=300)
    return LLMCluster(app=LLM_APP, config=config, endpoints=endpoints)


@contextmanager
def direct_stack(cluster: LLMCluster, **spec: Any) -> Iterator[DirectStreamStack]:
    """HAProxy + a router app in front of the session's LLM app, on free loopback ports; stopped on exit."""
    settings = DirectStreamSpec(app=cluster.app, haproxy_port=free_port(), prometheus_port=free_port(), **spec)
    register_frontend(settings.haproxy_port)
    started = DirectStreamStack(settings).start(deploy_model=False)
    try:
        yield started
    finally:
        started.stop()
