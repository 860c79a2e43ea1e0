"""The LLM replica: a Ray Serve replica running a real vLLM engine behind vLLM's own OpenAI app.

The app, wrapped in sluice's middleware, is served on the replica's own port by Serve's direct ingress
(docs/design.md §5), so Serve still counts every request against `max_ongoing_requests` and autoscaling. Its
lifecycle, variants (data parallel, prefill/decode, the benchmark stand-in) and settings: services/replica/README.md.
"""

from __future__ import annotations

import functools
import os
from collections.abc import AsyncIterator
from typing import Any, Literal

import httpx
import ray
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from ray import serve
from ray.serve.deployment import Application, Deployment

from base.contracts import (
    ENGINE_LOAD_PATH,
    FAULT_PATH,
    KV_EVENTS_PATH,
    SIM_STAND_IN,
    VERSIONS_PATH,
    ZERO_COMPUTE_STAND_IN,
)
from base.route_wire import ComponentVersions, KVEventSource, KVEventSources
from base.runtime import engine_env, free_port
from base.tracing import ENGINE_SERVICE, REPLICA_SERVICE, ProcessTracer
from routers.ledger_actor import ledger_actor_name
from services.internal_credential import InternalCredentialMiddleware, internal_credential, internal_headers
from services.replica.asgi_call import ResponseStart, stream_asgi
from services.replica.engine_load import EngineLoadBoard, load_logger_factory
from services.replica.llm_config import LLMAppConfig
from services.replica.middleware.capacity_release import CapacityReleaseMiddleware, NamedLedgerClient
from services.replica.middleware.disconnect_on_cancel import DisconnectOnCancelMiddleware
from services.replica.middleware.remote_prefill import RemotePrefillMiddleware
from services.replica.middleware.replica_headers import ReplicaHeadersMiddleware
from services.replica.middleware.tracing import TracingMiddleware
from services.replica.middleware.usage_report import UsageReportMiddleware
from services.replica.prefill_endpoints import KnownPrefillURLs
from services.replica.rank_gang import RankGang
from services.replica.vllm_app import build_openai_app, parse_engine_args, require_model_folder, start_engine
from services.serve_internals import list_replica_endpoints, with_rollout_version


class ReplicaFault(BaseModel):
    kv_events: Literal["on", "off"]


@serve.ingress()
class LLMReplica:
    async def __init__(self, config: dict[str, Any]) -> None:
        self._config = LLMAppConfig.model_validate(config)
        require_model_folder(self._config.engine)
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        engine = self._config.traced_engine()
        tracing = self._config.tracing
        self._tracer = ProcessTracer(tracing, REPLICA_SERVICE) if tracing.enabled else None
        if tracing.enabled:
            # vLLM's tracer (OpenTelemetry's default provider, in this process and its engine's) reads these.
            os.environ.update(tracing.engine_env(ENGINE_SERVICE))
        self._prefill_client: httpx.AsyncClient | None = None
        self._gang: RankGang | None = None
        # vLLM advertises this address to its peers (KV transfer, ranks): the node's, loopback on one machine.
        os.environ["VLLM_HOST_IP"] = ray.util.get_node_ip_address()
        if self._config.prefill_decode is not None:
            os.environ.update(kv_side_channel_env())
        data_parallel = self._config.data_parallel
        if data_parallel is not None and data_parallel.mode == "in_engine":
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = engine_cpu_binding(context.rank.local_rank, data_parallel.size)
        if data_parallel is not None and data_parallel.mode == "ranks":
            self._gang = RankGang()
            rank_args = await self._gang.engine_args()
            engine = engine.model_copy(update={"extra_args": {**engine.extra_args, **rank_args}})
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = engine_cpu_binding(context.rank.local_rank, 1)
        self._engine: Any = None
        self._sim: Any = None
        self._kv_events_off = False
        if self._config.engine_stand_in == SIM_STAND_IN:
            # Imported here: a replica running vLLM never needs the simulator's modules.
            from services.replica.sim.serve_engine import SimServeEngine

            self._sim = await SimServeEngine.start(
                engine.model, engine.served_model_name, self.replica_id, os.environ["VLLM_HOST_IP"]
            )
            self._app = self._sim.app
        else:
            self._args = parse_engine_args(engine)
            self._load = EngineLoadBoard()
            self._engine = start_engine(self._args, [load_logger_factory(self._load)])
            self._app = await build_openai_app(self._serving_engine(), self._args)
            self._app.add_api_route(KV_EVENTS_PATH, self.kv_event_sources, methods=["GET"])
            self._app.add_api_route(ENGINE_LOAD_PATH, self.engine_load, methods=["GET"])
        self._app.add_api_route(VERSIONS_PATH, self.versions, methods=["GET"])
        if self._config.fault_injection:
            self._app.add_api_route(FAULT_PATH, self.inject_fault, methods=["POST"], status_code=204)
        # vLLM's build_app builds its middleware stack eagerly; clear it so Starlette rebuilds it lazily with ours
        # outermost: the internal credential, the request's span (when tracing), the cancel-to-disconnect, the headers
        # stamp, the usage report, the capacity release, the remote prefill, then vLLM's.
        self._app.middleware_stack = None
        role = self._config.prefill_decode
        if role is not None and role.role == "decode":
            limits = httpx.Limits(max_connections=self._config.deployment.max_ongoing_requests)
            self._prefill_client = httpx.AsyncClient(limits=limits, headers=internal_headers())
            self._app.add_middleware(
                RemotePrefillMiddleware,
                replica_id=self.replica_id,
                local_fallback=role.local_prefill_fallback,
                timeout_s=role.prefill_timeout_s,
                client=self._prefill_client,
                prefill_urls=KnownPrefillURLs(
                    role.prefill_app, functools.partial(list_replica_endpoints, role.prefill_app)
                ),
            )
        if self._config.deployment.capacity_ledger:
            context = serve.get_replica_context()
            ledger = NamedLedgerClient(ledger_actor_name(context.app_name, self._config.deployment.name))
            self._app.add_middleware(CapacityReleaseMiddleware, ledger=ledger)
        # Only a request a platform forwarded for a tenant with a token quota is read for its usage.
        self._app.add_middleware(UsageReportMiddleware)
        rank = self._gang.rank if self._gang is not None else None
        stand_in = self._config.engine_stand_in
        self._app.add_middleware(
            ReplicaHeadersMiddleware,
            replica_id=self.replica_id,
            echo_request_id=False,
            data_parallel_rank=rank,
            engine_stand_in=stand_in,
        )
        self._app.add_middleware(DisconnectOnCancelMiddleware)
        if self._tracer is not None:
            self._app.add_middleware(TracingMiddleware, tracer=self._tracer.tracer, replica_id=self.replica_id)
        # A request that did not come through the frontend reaches nothing.
        self._internal = internal_headers()
        self._app.add_middleware(InternalCredentialMiddleware, credential=internal_credential())
        self._handle_app = ReplicaHeadersMiddleware(
            self._app, self.replica_id, echo_request_id=True, data_parallel_rank=rank, engine_stand_in=stand_in
        )

    def _serving_engine(self) -> Any:
        """What the app's handlers call: the engine, or the zero-compute stand-in wrapped around it."""
        if self._config.engine_stand_in != ZERO_COMPUTE_STAND_IN:
            return self._engine
        # Imported here: the module imports vLLM, which a driver importing this one must not pay for.
        from services.replica.zero_compute_engine import ZeroComputeEngineStandIn

        return ZeroComputeEngineStandIn(self._engine)

    async def __serve_build_asgi_app__(self) -> Any:
        return self._app

    async def inject_fault(self, fault: ReplicaFault) -> None:
        """Staging only: announce no KV event publisher (`"off"`), or the engine's again (`"on"`)."""
        self._kv_events_off = fault.kv_events == "off"

    async def kv_event_sources(self) -> JSONResponse:
        """Where this replica's engine ranks publish KV events (none when `--kv-events-config` is not set)."""
        sources = {
            rank: KVEventSource(endpoint=config.endpoint, replay_endpoint=config.replay_endpoint, topic=config.topic)
            for rank, config in self._engine.get_kv_event_sources().items()
            if config.publisher == "zmq" and not self._kv_events_off
        }
        block_size = self._engine.vllm_config.cache_config.block_size
        return JSONResponse(KVEventSources(block_size=block_size, sources=sources).model_dump(mode="json"))

    async def engine_load(self) -> JSONResponse:
        """The engine ranks' load as their schedulers last reported it."""
        return JSONResponse(self._load.report().model_dump(mode="json"))

    async def versions(self) -> JSONResponse:
        """The Ray and vLLM this replica runs."""
        return JSONResponse(ComponentVersions.installed().model_dump(mode="json"))

    async def check_health(self) -> None:
        if self._engine is not None:
            await self._engine.check_health()

    async def stream(
        self, method: str, path: str, body: bytes, headers: dict[str, str]
    ) -> AsyncIterator[ResponseStart | bytes]:
        """The HTTP request run through the same app in-process (for DeploymentHandle callers: inside the cluster, so
        the call carries the internal credential)."""
        own = {name: value for name, value in headers.items() if name.lower() not in self._internal}
        async for item in stream_asgi(self._handle_app, method, path, body, {**own, **self._internal}):
            yield item

    def __del__(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()
        sim = getattr(self, "_sim", None)
        if sim is not None:
            sim.shutdown()
        gang = getattr(self, "_gang", None)
        if gang is not None:
            gang.leave()
        tracer = getattr(self, "_tracer", None)
        if tracer is not None:
            tracer.shutdown()


def kv_side_channel_env() -> dict[str, str]:
    """This replica's NIXL side channel (where decode engines ask for its blocks' layout): the node's address and a
    port free now. Read by vLLM when the engine starts, so set before."""
    host = ray.util.get_node_ip_address()
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port(host))}


def engine_cpu_binding(local_rank: int, ranks: int, cpus: list[int] | None = None) -> str:
    """vLLM's `VLLM_CPU_OMP_THREADS_BIND` for a replica's engine ranks: each rank its own CPU, the replicas of a
    node taking consecutive CPUs (wrapping when there are fewer CPUs than ranks). vLLM's `auto` put every rank
    on CPU 0."""
    usable = cpus if cpus is not None else sorted(os.sched_getaffinity(0))
    return "|".join(str(usable[(local_rank * ranks + rank) % len(usable)]) for rank in range(ranks))


def replica_runtime_env(config: LLMAppConfig) -> dict[str, Any]:
    """The replicas' runtime_env: the driver's variables (what Serve gives a deployment without its own runtime_env,
    and only then) and the engine's for its hardware and weights (`base.runtime.engine_env`)."""
    driver = ray.get_runtime_context().runtime_env.env_vars() if ray.is_initialized() else {}
    engine = engine_env(config.engine.model, gpus=config.deployment.num_gpus > 0)
    return {"env_vars": {**driver, **engine}}


def llm_deployment(config: LLMAppConfig) -> Deployment:
    options = config.deployment.serve_options()
    options["ray_actor_options"]["runtime_env"] = replica_runtime_env(config)
    deployment = serve.deployment(LLMReplica).options(**options)
    return with_rollout_version(deployment, config.rollout_version())


def llm_application(config: LLMAppConfig) -> Application:
    return llm_deployment(config).bind(config.model_dump())


def build_llm_application(args: dict[str, Any]) -> Application:
    """Serve's application builder (`import_path: services.replica.llm_replica:build_llm_application`).

    `args` is an LLMAppConfig."""
    return llm_application(LLMAppConfig.model_validate(args))
