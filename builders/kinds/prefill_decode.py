"""The `prefill_decode` kind: each model a prefill role (KV producers) and a decode role (KV consumers, the replicas
HAProxy pins requests to), joined by vLLM's KV connector. The router app chooses a replica of each, each side with
its own policy (the prefill side's may be no policy with capacity tokens or KV events: `PolicyEntry.prefill_side`);
the legacy ingress, when retained, relays to the decode side and chooses the prefill replica itself. A router that
pairs each request with a prefill replica has no table, so `routing.table_decisions` is refused. On KubeRay each role
is a deployment of its own.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from builders import model_apps as parts
from builders.kinds.kind import ModelApps, TopologyKind
from builders.plan_types import model_path
from routers.registry import policy_entry, prefill_policy_choices
from services.replica.llm_config import EngineConfig, LLMAppConfig, PrefillDecodeRole
from services.router.settings import PrefillTarget
from topologies.problems import SpecProblem
from topologies.sections import EngineArgs, RoutingOverride, Scaling, Section
from topologies.spec import ModelBase, StackBase

NAME = "prefill_decode"
ROLES = ("prefill", "decode")


class Role(Scaling):
    """One side of a prefill/decode pair: its replicas, resources, engine overrides and policy."""

    engine: EngineArgs = Field(default_factory=dict)
    """Engine arguments of this role over the model's `engine`."""
    routing: RoutingOverride | None = None
    """This role's policy, settings or route timeout over the model's."""


class KVTransfer(Section):
    connector: Literal["NixlConnector", "ExampleConnector"] = "NixlConnector"
    """vLLM's KV connector between prefill and decode."""
    buffer_device: Literal["cpu", "cuda"] = "cpu"
    """Where the connector stages KV blocks (`cpu` or `cuda`)."""
    lease_s: float = Field(120.0, gt=0)
    """How long prefill keeps transferred blocks for decode to read (vLLM's default of 30 s ran out under load)."""
    extra_config: dict[str, Any] = Field(default_factory=dict)
    """Further `kv_connector_extra_config` for vLLM."""


class PrefillDecodeModel(ModelBase):
    prefill: Role
    """The prefill role: its scaling, resources, engine and routing overrides."""
    decode: Role
    """The decode role (the replicas clients stream from): its scaling, resources, engine and routing overrides."""
    kv_transfer: KVTransfer = KVTransfer()
    """How KV moves from prefill to decode (the connector)."""
    local_prefill_fallback: bool = False
    """When prefill fails: a clear error (default), or prefill on the decode replica (marked in a header)."""
    prefill_timeout_s: float = Field(60.0, gt=0)
    """How long a decode replica waits for its prefill call before it counts as failed."""


class PrefillDecodeStack(StackBase):
    kind: Literal["prefill_decode"]
    """The topology kind: `prefill_decode` (prefill and decode replicas, KV transferred between them)."""
    models: list[PrefillDecodeModel] = Field(min_length=1)
    """The served models, each with a prefill and a decode role."""


def _problems(spec: PrefillDecodeStack, index: int, model: PrefillDecodeModel) -> list[SpecProblem]:
    problems = []
    for role, side in _roles(model):
        why = model.unresolved_tool_call_parser(side.engine)
        if why is not None:
            problems.append(SpecProblem(f"models[{index}].{role}.engine.tool_call_parser", why))
    if model.simulated:
        message = "the simulator engine transfers no KV between replicas: use kind openai"
        problems.append(SpecProblem(f"models[{index}].engine", message))
    if spec.routing.table_decisions:
        problems.append(
            SpecProblem(
                "routing.table_decisions",
                f"models[{index}] is prefill/decode: its router pairs each request with a prefill replica, which no "
                "table holds; set routing.table_decisions: false",
            )
        )
    prefill_routing = spec.routing.overridden(model.routing).overridden(model.prefill.routing)
    prefill_entry = policy_entry(prefill_routing.policy)
    if not prefill_entry.prefill_side:
        problems.append(
            SpecProblem(
                f"models[{index}].prefill.routing.policy",
                f"{prefill_entry.prefill_refusal}: set {prefill_policy_choices()}",
            )
        )
    return problems


def _roles(model: PrefillDecodeModel) -> list[tuple[str, Role]]:
    return [(role, getattr(model, role)) for role in ROLES]


def _llm_deployments(model: PrefillDecodeModel) -> list[tuple[Scaling, int]]:
    return [(model.prefill, 1), (model.decode, 1)]


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


def _model_apps(spec: StackBase, index: int, model: PrefillDecodeModel, stem: str) -> ModelApps:
    """A model's prefill app, decode app and router app (choosing a replica of each), and the legacy ingress
    (relaying to the decode side, choosing the prefill replica itself) when the spec retains it."""
    prefill_app, decode_app, router_app = f"{stem}-prefill", f"{stem}-llm", f"{stem}-router"
    legacy_app = f"{stem}-legacy"
    model_routing = spec.routing.overridden(model.routing)
    prefill_routing = model_routing.overridden(model.prefill.routing)
    decode_routing = model_routing.overridden(model.decode.routing)
    prefill = LLMAppConfig(
        engine=_role_engine(model, "prefill"),
        deployment=parts.llm_deployment(model.prefill, prefill_routing),
        prefill_decode=PrefillDecodeRole(role="prefill"),
        tracing=spec.observability.tracing,
    )
    decode = LLMAppConfig(
        engine=parts.with_kv_events(_role_engine(model, "decode"), decode_routing),
        deployment=parts.llm_deployment(model.decode, decode_routing),
        prefill_decode=PrefillDecodeRole(
            role="decode",
            local_prefill_fallback=model.local_prefill_fallback,
            prefill_timeout_s=model.prefill_timeout_s,
            prefill_app=prefill_app,
        ),
        tracing=spec.observability.tracing,
    )
    target = PrefillTarget(
        app=prefill_app,
        route_prefix=f"/{prefill_app}",
        required=not model.local_prefill_fallback,
        capacity=model.prefill.max_ongoing_requests,
        policy=prefill_routing.policy,
        policy_kwargs=prefill_routing.policy_kwargs,
    )
    router = parts.router_settings(spec, decode_app, model, model.decode, decode_routing, prefill=target)
    planned = parts.planned_model(
        spec,
        index,
        model,
        decode_app,
        router_app,
        policy=decode_routing.policy,
        min_replicas=parts.min_replicas(model.decode),
        prefill_app=prefill_app,
        prefill_policy=prefill_routing.policy,
        prefill_replicas=parts.min_replicas(model.prefill),
        legacy_app=legacy_app,
        legacy_deployed=spec.ingress.retains_legacy,
        app_roles={
            prefill_app: f"prefill replicas of {model.name} (KV producers)",
            decode_app: f"decode replicas of {model.name} (KV consumers, pinned by HAProxy)",
        },
    )
    apps = [
        parts.llm_serve_app(prefill_app, prefill),
        parts.llm_serve_app(decode_app, decode),
        parts.router_serve_app(router_app, router, spec.frontend.routers),
    ]
    if spec.ingress.retains_legacy:
        apps.append(parts.legacy_serve_app(legacy_app, decode_app, spec.ingress.legacy_replicas, prefill_app))
    return apps, parts.model_route(model, decode_app, router_app, decode_routing, legacy_app), planned


KIND = TopologyKind(
    NAME,
    PrefillDecodeStack,
    _model_apps,
    problems=_problems,
    roles=_roles,
    llm_deployments=_llm_deployments,
)
