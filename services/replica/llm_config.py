"""Configuration of the LLM replica deployment: vLLM engine arguments plus Serve deployment options, data
parallelism and the prefill/decode role (`LLMAppConfig`). The defaults and why they are what they are:
services/replica/README.md (settings and constants).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from base.contracts import (
    DEFAULT_DRAIN_GRACE_S,
    DEFAULT_MAX_ONGOING_REQUESTS,
    SIM_STAND_IN,
    ZERO_COMPUTE_STAND_IN,
    NodeRole,
    node_role_resources,
)
from base.rollout import config_version
from base.runtime import DIRECT_INGRESS_MIN_DRAINING_PERIOD_S
from base.tiny_model import SERVED_MODEL_NAME
from base.tracing import Tracing
from routers.registry import validate_settings
from routers.serve_adapters import request_router_config
from services.serve_internals import SERVE_SHUTDOWN_BUFFER_S

# A `vllm serve` flag's value: a single value, or a map or list for vLLM's JSON-valued flags (`speculative_config`,
# `compilation_config`, `override_generation_config`, `lora_modules`, ...), which the command line carries as JSON.
EngineArgValue = str | int | float | bool | dict[str, Any] | list[Any]
# The defaults that only suit this machine's CPUs: a replica with GPUs leaves them to vLLM (unless a spec sets them).
CPU_ONLY_DEFAULTS = ("max_model_len", "max_num_seqs", "dtype", "enforce_eager", "kv_cache_memory_bytes")
# The LLM deployment's default name. Routers find the deployment's capacity ledger by this name
# (`ledger_actor_name(app, deployment)`), so the router's default target must be the same.
LLM_DEPLOYMENT_NAME = "LLMReplica"
# Serve would silently raise a shorter grace period to this; refuse it instead.
MIN_DRAIN_GRACE_S = DIRECT_INGRESS_MIN_DRAINING_PERIOD_S + SERVE_SHUTDOWN_BUFFER_S


class EngineConfig(BaseModel):
    """vLLM engine arguments. Named fields are the ones sluice relies on; `extra_args` passes any
    other `vllm serve` flag through vLLM's own argument parser (so vLLM validates it). The defaults are this
    machine's CPU facts; None leaves a setting to vLLM (what a GPU replica wants: `CPU_ONLY_DEFAULTS`)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    served_model_name: str = SERVED_MODEL_NAME
    max_model_len: int | None = Field(1024, gt=0)
    max_num_seqs: int | None = Field(64, gt=0)
    dtype: str | None = "bfloat16"
    # CPU facts (docs/design.md §5): compiled mode costs +40 s at start and its cache reload fails.
    enforce_eager: bool | None = True
    # A small KV cache: the VM's memory node reports ~9 GiB, so vLLM's default does not fit.
    kv_cache_memory_bytes: int | None = Field(64 * 1024 * 1024, gt=0)
    seed: int = 0
    # Tool calling, only where asked: vLLM's parser of the model's family (a spec's `tool_call_parser`, resolved by
    # `topologies.spec.ModelBase.engine_config`); None turns tool calling off.
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = True
    # "parameter": tool-call arguments always obey the tool's JSON schema, as if every tool were
    # `strict: true` (vLLM's "auto" only enforces it for tools that ask).
    tool_strict_level: Literal["auto", "function", "parameter"] = "parameter"
    extra_args: dict[str, EngineArgValue] = Field(default_factory=dict)

    @field_validator("extra_args")
    @classmethod
    def _flag_names(cls, value: dict[str, EngineArgValue]) -> dict[str, EngineArgValue]:
        for name in value:
            if not name.replace("-", "_").replace("_", "a").isalnum():
                raise ValueError(f"invalid engine flag name {name!r}")
        return value

    def cli_args(self) -> list[str]:
        """The `vllm serve` command line these settings stand for."""
        named: dict[str, EngineArgValue | None] = {
            "model": self.model,
            "served-model-name": self.served_model_name,
            "max-model-len": self.max_model_len,
            "max-num-seqs": self.max_num_seqs,
            "dtype": self.dtype,
            "enforce-eager": self.enforce_eager,
            "kv-cache-memory-bytes": self.kv_cache_memory_bytes,
            "seed": self.seed,
            "enable-auto-tool-choice": self.enable_auto_tool_choice and self.tool_call_parser is not None,
        }
        if self.tool_call_parser is not None:
            named["tool-call-parser"] = self.tool_call_parser
            named["tool-strict-level"] = self.tool_strict_level
        named.update({k.replace("_", "-"): v for k, v in self.extra_args.items()})
        args: list[str] = []
        for flag, value in named.items():
            if value is None:
                continue
            if isinstance(value, bool):
                if value:
                    args.append(f"--{flag}")
            elif isinstance(value, list):  # a flag that takes several values: each one after it
                args += [f"--{flag}", *map(_cli_value, value)]
            else:
                args += [f"--{flag}", _cli_value(value)]
        return args


def _cli_value(value: Any) -> str:
    """One value on the command line: maps and lists as JSON (what vLLM's parser reads for its JSON flags)."""
    return json.dumps(value) if isinstance(value, dict | list) else str(value)


class ReplicaDeploymentConfig(BaseModel):
    """Serve options of the LLM deployment. `max_ongoing_requests` is always explicit: Ray's
    default of 5 silently queues everything past the fifth stream."""

    model_config = ConfigDict(extra="forbid")

    name: str = LLM_DEPLOYMENT_NAME
    num_replicas: int = Field(2, ge=1)
    max_ongoing_requests: int = Field(DEFAULT_MAX_ONGOING_REQUESTS, ge=1)
    # How long a stopping replica lets in-flight streams finish before Serve kills it (aborting them).
    drain_grace_s: float = Field(DEFAULT_DRAIN_GRACE_S, ge=MIN_DRAIN_GRACE_S)
    # How often a draining replica re-counts its in-flight requests (Ray's default is 2 s).
    drain_poll_s: float = Field(0.25, gt=0)
    num_cpus: float = Field(0.25, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    accelerator_type: str | None = None
    # Serve's autoscaling (min_replicas, max_replicas, target_ongoing_requests); replaces num_replicas when set.
    autoscaling: dict[str, float] | None = None
    health_check_period_s: float = Field(5.0, gt=0)
    # Routers of this deployment take capacity tokens (a policy with a ledger): the replica releases each
    # request's token when the request ends (services.replica.middleware.capacity_release). Not a Serve option.
    capacity_ledger: bool = False
    # Replicas scheduled (and restarted) together as one gang of this size: `num_replicas` counts gangs.
    gang_size: int | None = Field(None, ge=2)
    # The policy DeploymentHandle calls (the legacy ingress) are routed with, through its Serve RequestRouter
    # adapter; None leaves Serve's own router.
    handle_policy: str | None = None
    handle_policy_kwargs: dict[str, Any] = Field(default_factory=dict)
    # A stack across nodes runs its replicas on worker nodes; None: one machine.
    node_role: NodeRole | None = None

    @model_validator(mode="after")
    def _handle_policy(self) -> ReplicaDeploymentConfig:
        if self.handle_policy is not None:
            validate_settings(self.handle_policy, self.handle_policy_kwargs)
        return self

    def serve_options(self) -> dict[str, Any]:
        actor: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.num_gpus:
            actor["num_gpus"] = self.num_gpus
        if self.accelerator_type is not None:
            actor["accelerator_type"] = self.accelerator_type
        if self.node_role is not None:
            actor["resources"] = node_role_resources(self.node_role)
        scaling: dict[str, Any] = (
            {"autoscaling_config": dict(self.autoscaling)} if self.autoscaling else {"num_replicas": self.num_replicas}
        )
        if self.gang_size is not None:
            scaling = {
                "num_replicas": self.num_replicas * self.gang_size,
                "gang_scheduling_config": {"gang_size": self.gang_size},
            }
        routing = (
            {"request_router_config": request_router_config(self.handle_policy, **self.handle_policy_kwargs)}
            if self.handle_policy is not None
            else {}
        )
        return {
            "name": self.name,
            **scaling,
            **routing,
            "max_ongoing_requests": self.max_ongoing_requests,
            "graceful_shutdown_timeout_s": self.drain_grace_s,
            "graceful_shutdown_wait_loop_s": self.drain_poll_s,
            "health_check_period_s": self.health_check_period_s,
            "ray_actor_options": actor,
        }


class DataParallelEngine(BaseModel):
    """vLLM data parallelism of a replica: `in_engine`, the replica runs `size` engine ranks behind one server;
    `ranks`, the replica is one rank of a gang of `size` replicas (its rank from Serve's gang context)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["in_engine", "ranks"]
    size: int = Field(ge=2, le=64)


class PrefillDecodeRole(BaseModel):
    """The replica's side of a prefill/decode pair; a decode replica runs each request's prefill on the prefill
    replica the router chose, then decodes locally from the transferred KV blocks."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["prefill", "decode"]
    # Decode only: when the prefill call fails, prefill locally (marked in a header) instead of an error.
    local_prefill_fallback: bool = False
    # Decode only: how long the prefill call may take (connect, send, and the prefill itself).
    prefill_timeout_s: float = Field(60.0, gt=0)
    # Decode only: the prefill app; a prefill URL is called only when it is one of this app's replicas.
    prefill_app: str = ""

    @model_validator(mode="after")
    def _decode_names_its_prefill_app(self) -> PrefillDecodeRole:
        if self.role == "decode" and not self.prefill_app:
            raise ValueError("a decode replica needs its prefill_app (the only replicas it sends a prefill to)")
        return self


class LLMAppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig
    deployment: ReplicaDeploymentConfig = Field(default_factory=ReplicaDeploymentConfig)
    data_parallel: DataParallelEngine | None = None
    prefill_decode: PrefillDecodeRole | None = None
    engine_stand_in: Literal[ZERO_COMPUTE_STAND_IN, SIM_STAND_IN] | None = Field(
        None,
        description=(
            "Benchmarks only: `zero_compute` answers every completion with `max_tokens` copies of one token without "
            "running the model (services.replica.zero_compute_engine), behind the same replica app; `sim` runs the "
            "simulator engine (services/replica/sim/: vLLM's prefix cache, KV events and metrics, a stated timing "
            "model) instead of vLLM, a team file's `engine: sim`. Either names itself in every response's "
            "`x-serve-engine-stand-in` header."
        ),
    )

    # Staging stacks only: `POST <prefix>/internal/fault {"kv_events": "off"}` makes the replica announce no KV event
    # publisher (routers then score it by what they sent it), `"on"` undoes it.
    fault_injection: bool = False
    # Each request a span (`services.replica.middleware.tracing`) and vLLM's own spans under it, sent to the stack's
    # OTLP receiver; off by default.
    tracing: Tracing = Field(default_factory=Tracing)

    @model_validator(mode="after")
    def _stand_in_alone(self) -> LLMAppConfig:
        # A decode replica needs the prefill replica's KV transfer parameters, which no stand-in produces.
        if self.engine_stand_in is not None and self.prefill_decode is not None:
            raise ValueError("engine_stand_in cannot serve a prefill/decode role")
        if self.engine_stand_in == SIM_STAND_IN and self.data_parallel is not None:
            raise ValueError("the simulator engine has no data parallel ranks")
        return self

    def rollout_version(self) -> str:
        """Serve's version of the deployment: everything but `num_replicas` and the handle policy, and the sluice
        release. Redeploying with another replica count only scales; another handle policy is Serve's
        `request_router_config`, which it applies to running replicas (the routing happens in the callers); any
        other change rolls the replicas."""
        in_place = {"num_replicas", "handle_policy", "handle_policy_kwargs"}
        return config_version(self.model_dump(mode="json", exclude={"deployment": in_place}))

    def traced_engine(self) -> EngineConfig:
        """The engine's settings, with vLLM's own tracing to the stack's receiver when tracing is on."""
        if not self.tracing.enabled:
            return self.engine
        extra = {**self.engine.extra_args, "otlp_traces_endpoint": self.tracing.url}
        return self.engine.model_copy(update={"extra_args": extra})
