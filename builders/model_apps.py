"""Each kind's Serve apps for one model of a spec: its LLM app(s), its router app, and its `AppRoute`.

- `openai`: an LLM app and a router app with the model's policy (plus a legacy ingress app when the stack retains
  the legacy path).
- `data_parallel`: the same, with vLLM data parallelism: `in_engine` runs `size` engine ranks per replica; `ranks`
  makes each replica one rank of a gang of `size` that Serve schedules and restarts together (`replicas` counts gangs).
- `prefill_decode`: a prefill app (KV producer) and a decode app (KV consumer, the replicas HAProxy pins to); the
  router app chooses from both, each side with its own policy.
"""

from __future__ import annotations

import json

from builders.plan_types import PlannedModel, ServeApp, import_path, model_path
from infra.haproxy.apps import AppRoute
from infra.haproxy.config import replica_backend, router_backend
from infra.haproxy.spoe import agent_timeout_s
from routers.registry import handle_policy, policy_entry
from services.legacy.ingress import LegacyIngressSettings, build_legacy_ingress_application
from services.replica.llm_config import (
    DataParallelEngine,
    EngineConfig,
    LLMAppConfig,
    PrefillDecodeRole,
    ReplicaDeploymentConfig,
)
from services.replica.llm_replica import build_llm_application
from services.router.service import build_router_application
from services.router.settings import PrefillTarget, RouterAppArgs, RouterSettings
from topologies.sections import Routing, Scaling
from topologies.spec import (
    DataParallelModel,
    KVTransfer,
    ModelBase,
    OpenAIModel,
    PrefillDecodeModel,
    StackBase,
)

ModelApps = tuple[list[ServeApp], AppRoute, PlannedModel]
# vLLM binds this publisher endpoint to the node's address (`VLLM_HOST_IP`, set by the replica) at a port the OS
# picks, not to every interface as `*` elsewhere would.
KV_EVENTS_ANY_PORT = "tcp://*:0"


def _deployment(scaling: Scaling, routing: Routing, gang_size: int | None = None) -> ReplicaDeploymentConfig:
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


def _min_replicas(scaling: Scaling) -> int:
    return scaling.autoscaling.min_replicas if scaling.autoscaling else scaling.fixed_replicas


def _llm_serve_app(name: str, config: LLMAppConfig) -> ServeApp:
    return ServeApp(
        name=name,
        route_prefix=f"/{name}",
        import_path=import_path(build_llm_application),
        args=config.model_dump(mode="json"),
    )


def _router_serve_app(name: str, settings: RouterSettings, routers: int) -> ServeApp:
    args = RouterAppArgs(settings=settings, num_replicas=routers)
    return ServeApp(
        name=name,
        route_prefix=f"/{name}",
        import_path=import_path(build_router_application),
        args=args.model_dump(mode="json"),
    )


def _legacy_serve_app(name: str, llm_app: str, replicas: int, prefill_app: str | None = None) -> ServeApp:
    settings = LegacyIngressSettings(target_app=llm_app, num_replicas=replicas, prefill_app=prefill_app)
    return ServeApp(
        name=name,
        route_prefix=f"/{name}",
        import_path=import_path(build_legacy_ingress_application),
        args=settings.model_dump(mode="json"),
    )


def _route(
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


def _planned(
    spec: StackBase, index: int, model: ModelBase, llm_app: str, router_app: str, **roles: object
) -> PlannedModel:
    return PlannedModel(
        name=model.name,
        llm_app=llm_app,
        router_app=router_app,
        replica_backend=replica_backend(index),
        router_backend=router_backend(index),
        routers=spec.frontend.routers,
        **roles,
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


def _with_kv_events(engine: EngineConfig, routing: Routing) -> EngineConfig:
    if not routing.publishes_kv_events:
        return engine
    return engine.model_copy(update={"extra_args": {**engine.extra_args, "kv_events_config": kv_events_config()}})


def _router_settings(
    spec: StackBase, llm_app: str, model: ModelBase, scaling: Scaling, routing: Routing, **extra: object
) -> RouterSettings:
    needs_prompt = policy_entry(routing.policy).needs_prompt
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
        **extra,
    )


def openai_model_apps(spec: StackBase, index: int, model: OpenAIModel, stem: str) -> ModelApps:
    """A model's LLM app and router app (data parallel when the model says so)."""
    llm_app, router_app, legacy_app = f"{stem}-llm", f"{stem}-router", f"{stem}-legacy"
    routing = spec.routing.overridden(model.routing)
    engine = _with_kv_events(model.engine_config(model_path(model.source), gpus=model.resources.gpus > 0), routing)
    data_parallel = None
    gang_size = None
    in_engine_ranks = 1
    if isinstance(model, DataParallelModel):
        data_parallel = DataParallelEngine(mode=model.data_parallel.mode, size=model.data_parallel.size)
        extra = {**engine.extra_args, "data_parallel_size": data_parallel.size}
        engine = engine.model_copy(update={"extra_args": extra})
        gang_size = data_parallel.size if data_parallel.mode == "ranks" else None
        in_engine_ranks = data_parallel.size if data_parallel.mode == "in_engine" else 1
    llm = LLMAppConfig(
        engine=engine,
        deployment=_deployment(model, routing, gang_size),
        data_parallel=data_parallel,
        fault_injection=spec.staging,
    )
    planned = _planned(
        spec,
        index,
        model,
        llm_app,
        router_app,
        policy=routing.policy,
        min_replicas=_min_replicas(model) * (gang_size or 1),
        data_parallel=data_parallel.mode if data_parallel else None,
        data_parallel_size=data_parallel.size if data_parallel else 1,
        legacy_app=legacy_app,
        legacy_deployed=spec.ingress.retains_legacy,
    )
    apps = [
        _llm_serve_app(llm_app, llm),
        _router_serve_app(
            router_app,
            _router_settings(spec, llm_app, model, model, routing, data_parallel_size=in_engine_ranks),
            spec.frontend.routers,
        ),
    ]
    if spec.ingress.retains_legacy:
        apps.append(_legacy_serve_app(legacy_app, llm_app, spec.ingress.legacy_replicas))
    return apps, _route(model, llm_app, router_app, routing, legacy_app), planned


def kv_transfer_config(kv: KVTransfer, role: str) -> str:
    """vLLM's `--kv-transfer-config` for one side (`kv_producer` prefills, `kv_consumer` decodes)."""
    extra = {"kv_lease_duration": kv.lease_s, **kv.extra_config}
    config = {
        "kv_connector": kv.connector,
        "kv_role": role,
        "kv_buffer_device": kv.buffer_device,
        "kv_connector_extra_config": extra,
    }
    return json.dumps(config, separators=(",", ":"), sort_keys=True)


def _role_engine(model: PrefillDecodeModel, role: str) -> EngineConfig:
    side = model.prefill if role == "prefill" else model.decode
    engine = model.engine_config(model_path(model.source), side.engine, gpus=side.resources.gpus > 0)
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    extra = {**engine.extra_args, "kv_transfer_config": kv_transfer_config(model.kv_transfer, kv_role)}
    return engine.model_copy(update={"extra_args": extra})


def prefill_decode_model_apps(spec: StackBase, index: int, model: PrefillDecodeModel, stem: str) -> ModelApps:
    """A model's prefill app, decode app and router app (choosing a replica of each), and the legacy ingress
    (relaying to the decode side, choosing the prefill replica itself) when the spec retains it."""
    prefill_app, decode_app, router_app = f"{stem}-prefill", f"{stem}-llm", f"{stem}-router"
    legacy_app = f"{stem}-legacy"
    model_routing = spec.routing.overridden(model.routing)
    prefill_routing = model_routing.overridden(model.prefill.routing)
    decode_routing = model_routing.overridden(model.decode.routing)
    prefill = LLMAppConfig(
        engine=_role_engine(model, "prefill"),
        deployment=_deployment(model.prefill, prefill_routing),
        prefill_decode=PrefillDecodeRole(role="prefill"),
    )
    decode = LLMAppConfig(
        engine=_with_kv_events(_role_engine(model, "decode"), decode_routing),
        deployment=_deployment(model.decode, decode_routing),
        prefill_decode=PrefillDecodeRole(
            role="decode",
            local_prefill_fallback=model.local_prefill_fallback,
            prefill_timeout_s=model.prefill_timeout_s,
            prefill_app=prefill_app,
        ),
    )
    target = PrefillTarget(
        app=prefill_app,
        route_prefix=f"/{prefill_app}",
        required=not model.local_prefill_fallback,
        capacity=model.prefill.max_ongoing_requests,
        policy=prefill_routing.policy,
        policy_kwargs=prefill_routing.policy_kwargs,
    )
    router = _router_settings(spec, decode_app, model, model.decode, decode_routing, prefill=target)
    planned = _planned(
        spec,
        index,
        model,
        decode_app,
        router_app,
        policy=decode_routing.policy,
        min_replicas=_min_replicas(model.decode),
        prefill_app=prefill_app,
        prefill_policy=prefill_routing.policy,
        prefill_replicas=_min_replicas(model.prefill),
        legacy_app=legacy_app,
        legacy_deployed=spec.ingress.retains_legacy,
    )
    apps = [
        _llm_serve_app(prefill_app, prefill),
        _llm_serve_app(decode_app, decode),
        _router_serve_app(router_app, router, spec.frontend.routers),
    ]
    if spec.ingress.retains_legacy:
        apps.append(_legacy_serve_app(legacy_app, decode_app, spec.ingress.legacy_replicas, prefill_app))
    return apps, _route(model, decode_app, router_app, decode_routing, legacy_app), planned
