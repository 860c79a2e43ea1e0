"""The integration session's LLM app (two tiny-model replicas) and a direct-streaming stack in front of it."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from base.tiny_model import TINY_TOOL_CALL_PARSER
from base.tracing import Tracing
from services.replica.llm_config import EngineConfig, LLMAppConfig, ReplicaDeploymentConfig
from services.serve_internals import ReplicaEndpoint
from sluice.bench.stack_harness import DirectStreamSpec, DirectStreamStack
from tests.support.frontend_contract import register_frontend
from tests.support.ports import free_port

LLM_APP = "llm"
_stack_numbers = itertools.count(1)


@dataclass
class LLMCluster:
    app: str
    config: LLMAppConfig
    endpoints: list[ReplicaEndpoint]


def deploy_llm_app(
    name: str,
    model: Path,
    deployment: ReplicaDeploymentConfig,
    route_prefix: str = "/",
    tracing: Tracing | None = None,
    **engine: Any,
) -> LLMAppConfig:
    """Deploy an LLM app; its replicas serve `route_prefix` + vLLM's paths on their own ports, and trace as `tracing`
    says (None: off). `engine`: further `EngineConfig` fields."""
    from ray import serve

    from services.replica.llm_replica import llm_application

    # The tiny model's tool calling, as a spec serving it has (the forced tool call tests ask one).
    engine = {"tool_call_parser": TINY_TOOL_CALL_PARSER, **engine}
    config = LLMAppConfig(
        engine=EngineConfig(model=str(model), **engine), deployment=deployment, tracing=tracing or Tracing()
    )
    serve.run(llm_application(config), name=name, route_prefix=route_prefix, blocking=False)
    return config


@contextmanager
def direct_stack(cluster: LLMCluster, **spec: Any) -> Iterator[DirectStreamStack]:
    """HAProxy + a router app in front of the session's LLM app, on free loopback ports; stopped on exit. The router
    app gets a name of its own unless given one, so Serve drains it while the next stack starts."""
    spec.setdefault("router_name", f"{cluster.app}-router-{next(_stack_numbers)}")
    settings = DirectStreamSpec(app=cluster.app, haproxy_port=free_port(), prometheus_port=free_port(), **spec)
    register_frontend(settings.haproxy_port)
    started = DirectStreamStack(settings).start(deploy_model=False)
    try:
        yield started
    finally:
        started.stop(wait_for_delete=False)
