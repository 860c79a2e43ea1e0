"""The parts every kind's apps are made of (`builders/kinds/`): an LLM app, a router app, a legacy ingress app, the
frontend's `AppRoute` to a model, the LLM deployment's Serve options, the router's settings, the planned model, and
vLLM's KV event publisher when the routing follows KV events.
"""

from __future__ import annotations

import json

from builders.plan_types import PlannedModel, ServeApp, import_path, model_path
from infra.haproxy.apps import AppRoute
from infra.haproxy.config import replica_backend, router_backend
from infra.haproxy.spoe import agent_timeout_s
from routers.registry import handle_policy, policy_entry
from services.legacy.ingress import LegacyIngressSettings, build_legacy_ingress_application
from services.replica.llm_config import EngineConfig, LLMAppConfig, ReplicaDeploymentConfig
from services.replica.llm_replica import build_llm_application
from services.router.service import build_router_application
from services.router.settings import RouterAppArgs, RouterSettings
from topologies.sections import Routing, Scaling
from topologies.spec import ModelBase, StackBase

# vLLM binds this publisher endpoint to the node's address (`VLLM_HOST_IP`, set by the replica) at a port the OS
# picks, not to every interface as `*` elsewhere would.
KV_EVENTS_ANY_PORT = "tcp://*:0"


def llm_deployment(scaling: Scaling, routing: Routing, gang_size: int | None = None) -> ReplicaDeploymentConfig:
    """The LLM deployment's Serve options; the legacy ingress's handle calls route with the model's policy too (one
    that reads the prompt routes them by load: `routers.registry.handle_policy`)."""
    policy, kwargs = handle_policy(routing.policy, routing.policy_kwargs)
    return ReplicaDeploymentConfig(
        handle_policy=policy,
        handle_policy_kwargs=kwargs,
        num_replicas=scaling.fixed_replicas,
        autoscaling=scaling.autoscaling.model_dump() if scaling.autoscaling else None,
        max_ongoing_requests=scaling.max_ongoing_requests,
        num_cpus=scaling.resources.cpus,
        num_gpus=scaling.resources.gpus,
        accelerator_type=scaling.resources.accelerator_type,
        capacity_ledger=policy_entry(routing.policy).needs_ledger,
        gang_size=gang_size,
    )


def min_replicas(scaling: Scaling) -> int:
    return scaling.autoscaling.min_replicas if scaling.autoscaling else scaling.fixed_replicas


def llm_serve_app(name: str, config: LLMAppConfig) -> ServeApp:
    return ServeApp(
        name=name,
        route_prefix=f"/{name}",
        import_path=import_path(build_llm_application),
        args=config.model_dump(mode="json"),
    )


def router_serve_app(name: str, settings: RouterSettings, routers: int) -> ServeApp:
    args = RouterAppArgs(settings=settings, num_replicas=routers)
    return ServeApp(
        name=name,
        route_prefix=f"/{name}",
        import_path=import_path(build_router_application),
        args=args.model_dump(mode="json"),
    )


def legacy_serve_app(name: str, llm_app: str, replicas: int, prefill_app: str | None = None) -> ServeApp:
    settings = LegacyIngressSettings(target_app=llm_app, num_replicas=replicas, prefill_app=prefill_app)
    return ServeApp(
        name=name,
        route_prefix=f"/{name}",
        import_path=import_path(build_legacy_ingress_application),
        args=settings.model_dump(mode="json"),
    )


def model_route(
    model: ModelBase, llm_app: str, router_app: str, routing: Routing, legacy_app: str | None = None
) -> AppRoute:
    return AppRoute(
        legacy_route_prefix=f"/{legacy_app}" if legacy_app is not None else None,
        name=llm_app,
        model=model.name,
        fail_open=routing.fail_mode == "open",
        forward_body=routing.forward_body,
        body_buffer_bytes=routing.body_buffer_bytes,
        session_header=routing.session_header,
        table_decisions=routing.table_decisions,
        router_route_prefix=f"/{router_app}",
        replica_route_prefix=f"/{llm_app}",
    )


def planned_model(
    spec: StackBase, index: int, model: ModelBase, llm_app: str, router_app: str, **roles: object
) -> PlannedModel:
    """What the plan says of a model; its LLM app is `replicas of <model>` unless the kind's `app_roles` say more."""
    return PlannedModel(
        name=model.name,
        llm_app=llm_app,
        router_app=router_app,
        replica_backend=replica_backend(index),
        router_backend=router_backend(index),
        routers=spec.frontend.routers,
        **{"app_roles": {llm_app: f"replicas of {model.name}"}, **roles},
    )


def kv_events_config() -> str:
    """vLLM's `--kv-events-config`: ZMQ publishers on this node's address (`VLLM_HOST_IP`) at ports the OS picks,
    with a replay socket; the replica tells routers where (`KV_EVENTS_PATH`)."""
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": KV_EVENTS_ANY_PORT,
        "replay_endpoint": KV_EVENTS_ANY_PORT,
    }
    return json.dumps(config, separators=(",", ":"), sort_keys=True)


def with_kv_events(engine: EngineConfig, routing: Routing) -> EngineConfig:
    if not routing.publishes_kv_events:
        return engine
    return engine.model_copy(update={"extra_args": {**engine.extra_args, "kv_events_config": kv_events_config()}})


def router_settings(
    spec: StackBase, llm_app: str, model: ModelBase, scaling: Scaling, routing: Routing, **extra: object
) -> RouterSettings:
    needs_prompt = policy_entry(routing.policy).needs_prompt or bool(routing.shadow_policies)
    return RouterSettings(
        # HAProxy's route timeout is the stack's (infra/haproxy/spoe.py renders the agent's share of it).
        agent_deadline_s=agent_timeout_s(spec.routing.route_timeout_s),
        model_path=model_path(model.source) if needs_prompt else None,
        target_route_prefix=f"/{llm_app}",
        fault_injection=spec.staging,
        target_app=llm_app,
        target_capacity=scaling.max_ongoing_requests,
        policy=routing.policy,
        policy_kwargs=routing.policy_kwargs,
        session_header=routing.session_header,
        shadow_policies=routing.shadow_policies,
        tracing=spec.observability.tracing,
        **extra,
    )
