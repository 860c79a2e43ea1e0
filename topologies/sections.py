"""The sections a team topology spec is made of: how a model scales and what it runs on, how requests are
routed, and the frontend. Every model forbids unknown keys; a validator's message says what to change."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from base.contracts import (
    DEFAULT_MAX_ONGOING_REQUESTS,
    HAPROXY_PORT_DEFAULT,
    HAPROXY_PROMETHEUS_PORT_DEFAULT,
    ROUTE_TIMEOUT_S_DEFAULT,
    SESSION_HEADER_DEFAULT,
)
from base.spec_config import SPEC_SECTION_CONFIG
from base.tracing import Tracing
from infra.haproxy.apps import BODY_BUFFER_BYTES_DEFAULT, session_header_name
from infra.haproxy.protection import FrontendProtection
from infra.haproxy.tls import FrontendTLS
from routers.registry import (
    DEFAULT_POLICY,
    PolicyConfigError,
    PolicyName,
    policy_entry,
    table_policy_choices,
    validate_settings,
)
from routers.shadows import shadow_refusal
from services.frontend.canary_guard import AbortCriteria
from services.frontend.ingress_control import DRAIN_DEADLINE_S_DEFAULT, IngressConfig
from services.replica.llm_config import EngineArgValue

# Names that become Serve app names, HAProxy identifiers and metric labels.
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


class Section(BaseModel):
    model_config = SPEC_SECTION_CONFIG


class Resources(Section):
    """What one replica (or one rank, or one role replica) asks Ray for."""

    cpus: float = Field(1.0, ge=0)
    """CPUs each replica (or rank, or role replica) asks Ray for."""
    gpus: float = Field(0.0, ge=0)
    """GPUs each replica asks Ray for; 0 runs vLLM on CPUs with this machine's CPU defaults."""
    accelerator_type: str | None = None
    """Ray's accelerator type (e.g. "H100", "A10G"); only meaningful with GPUs."""

    @model_validator(mode="after")
    def _accelerator_needs_gpus(self) -> Resources:
        if self.accelerator_type is not None and self.gpus == 0:
            raise ValueError("accelerator_type needs gpus > 0: set gpus, or remove accelerator_type")
        return self


class Autoscaling(Section):
    min_replicas: int = Field(1, ge=0)
    """Replicas Serve keeps at the least (the stack waits for these at deploy)."""
    max_replicas: int = Field(ge=1)
    """Replicas Serve may scale up to."""
    target_ongoing_requests: float = Field(DEFAULT_MAX_ONGOING_REQUESTS / 2, gt=0)
    """Requests in flight per replica Serve's autoscaler aims at; at most `max_ongoing_requests`."""

    @model_validator(mode="after")
    def _bounds(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas}): lower min_replicas "
                "or raise max_replicas"
            )
        return self


class Scaling(Section):
    """How many replicas, fixed or autoscaled, and what each asks for."""

    replicas: int | None = Field(None, ge=1)
    """A fixed replica count (1 when neither this nor `autoscaling` is given)."""
    autoscaling: Autoscaling | None = None
    """Serve's autoscaling (`min_replicas`, `max_replicas`, `target_ongoing_requests`) instead of a fixed count."""
    max_ongoing_requests: int = Field(DEFAULT_MAX_ONGOING_REQUESTS, ge=1)
    """Each replica's capacity: requests in flight at once before the router passes it over."""
    resources: Resources = Resources()
    """What each replica asks Ray for (`cpus`, `gpus`, `accelerator_type`)."""

    @model_validator(mode="after")
    def _one_way_to_scale(self) -> Scaling:
        if self.replicas is not None and self.autoscaling is not None:
            raise ValueError("give either replicas (a fixed count) or autoscaling (min/max), not both")
        if self.autoscaling and self.autoscaling.target_ongoing_requests > self.max_ongoing_requests:
            raise ValueError(
                "autoscaling.target_ongoing_requests is above max_ongoing_requests: the target could never be reached"
            )
        return self

    @property
    def fixed_replicas(self) -> int:
        """The replica count when not autoscaled (1 when the spec says neither)."""
        return self.replicas if self.replicas is not None else 1


class RoutingOverride(Section):
    """Per-model routing: any field left out keeps the stack's value."""

    policy: PolicyName | None = None
    """This model's routing policy instead of the stack's."""
    policy_kwargs: dict[str, Any] | None = None
    """Its policy's settings (a new policy starts from none of the stack's)."""
    route_timeout_s: float | None = Field(None, gt=0, le=60)
    """This model's route call deadline instead of the stack's."""


class Routing(Section):
    """How the frontend routes a stack's requests (a stack default; models may override policy and timeout)."""

    policy: PolicyName = DEFAULT_POLICY
    """The routing policy that picks each request's replica (docs/policies.md)."""
    policy_kwargs: dict[str, Any] = Field(default_factory=dict)
    """The policy's settings (docs/policies.md lists each policy's)."""
    session_header: str = SESSION_HEADER_DEFAULT
    """The request header that keeps a session on one replica."""
    fail_mode: Literal["closed", "open"] = "closed"
    """closed: a request the router could not place gets 503 with a reason; open: it is load-balanced instead."""
    forward_body: bool = False
    """Send the request body (up to body_buffer_bytes) to the router: body-aware policies and multi-model stacks."""
    body_buffer_bytes: int = Field(BODY_BUFFER_BYTES_DEFAULT, ge=1024, le=64 * 1024 * 1024)
    """How much of the body the frontend buffers and forwards to the router (`forward_body`)."""
    route_timeout_s: float = Field(ROUTE_TIMEOUT_S_DEFAULT, gt=0, le=60)
    """The route call's deadline in seconds; past it the request fails as `fail_mode` says."""
    kv_events: bool | None = None
    """The replicas publish vLLM's KV events: None, when the policy scores by them (kv_aware); true keeps them on under
    any policy (comparing policies on the same replicas), false turns them off (kv_aware then approximates)."""
    table_decisions: bool = False
    """The frontend ranks each request from the routers' table (a rotation, a hash ring) with no route call, where the
    policy is a function of the replica set and the request's headers (docs/data-plane.md, table decisions)."""
    shadow_policies: list[PolicyName] = Field(default_factory=list)
    """Policies each router also runs on every request without acting on it: what each would have hit and how it would
    have spread the load, beside the live policy's (`sluice status`; routers/README.md, shadow policies). They read
    the prompt (routing.forward_body) and the replicas' KV events (turned on for them)."""

    @field_validator("session_header")
    @classmethod
    def _session_header(cls, value: str) -> str:
        return session_header_name(value)

    @property
    def publishes_kv_events(self) -> bool:
        if self.kv_events is not None:
            return self.kv_events
        return policy_entry(self.policy).kv_events or bool(self.shadow_policies)

    def overridden(self, override: RoutingOverride | None) -> Routing:
        """This routing with a model's overrides applied (a new policy starts from empty kwargs)."""
        if override is None:
            return self
        update: dict[str, Any] = {k: v for k, v in override.model_dump().items() if v is not None}
        if override.policy is not None and override.policy_kwargs is None:
            update["policy_kwargs"] = {}
        return self.model_copy(update=update)


def policy_problem(routing: Routing) -> tuple[str, str] | None:
    """(field, message) of what is wrong with the policy's kwargs or their cross-field rules, or None."""
    try:
        settings = validate_settings(routing.policy, routing.policy_kwargs)
    except PolicyConfigError as error:
        return "policy_kwargs", f"{error}; docs/policies.md lists each policy's kwargs"
    if routing.table_decisions and policy_entry(routing.policy).table(settings) is None:
        return "table_decisions", (
            f"{routing.policy} with these kwargs decides each request from live state or the body, which no table "
            f"holds: choose {table_policy_choices()} with kwargs that keep a table (docs/policies.md), or set "
            "routing.table_decisions: false"
        )
    for name in routing.shadow_policies:
        entry = policy_entry(name)
        refusal = shadow_refusal(entry.needs_prompt, entry.needs_ledger)
        if refusal is not None:
            return (
                "shadow_policies",
                f"{name} cannot shadow: it {refusal}; choose policies that need no prompt or ledger",
            )
    if routing.shadow_policies and not routing.forward_body:
        return "shadow_policies", "shadow policies are scored on the prompt: set routing.forward_body: true"
    if routing.shadow_policies and routing.kv_events is False:
        return "shadow_policies", "shadow policies are scored on the replicas' KV events: drop routing.kv_events: false"
    body_use = policy_entry(routing.policy).body_use(settings)
    if body_use is not None and not routing.forward_body:
        kwarg, reads = body_use
        if kwarg == "policy":  # the policy itself reads the body, whatever its kwargs
            return "policy", f"{reads}: set routing.forward_body: true, or choose another policy"
        return f"policy_kwargs.{kwarg}", f"{reads}: set routing.forward_body: true, or drop {kwarg}"
    return None


class Frontend(Section):
    """The stack's HAProxy: where it listens, how many routers it asks, and how it protects the replicas."""

    port: int = Field(HAPROXY_PORT_DEFAULT, ge=1, le=65535)
    """HAProxy's public port (the OpenAI API)."""
    metrics_port: int = Field(HAPROXY_PROMETHEUS_PORT_DEFAULT, ge=1, le=65535)
    """HAProxy's Prometheus and stats port."""
    routers: int = Field(1, ge=1)
    """Router replicas of each model's router app."""
    protection: FrontendProtection = FrontendProtection()
    """Timeouts, size limits, API keys and per-client limits, enforced before any route call."""
    tls: FrontendTLS | None = None
    """TLS on `port` (docs/data-plane.md, TLS at the frontend); None: plain HTTP."""
    platform: str | None = None
    """The platform (topologies/platform.py) whose frontend serves this stack's models: the stack's own HAProxy then
    listens on loopback ports of its own choosing, and keys, TLS and the public port are the platform's."""

    @model_validator(mode="after")
    def _attached_has_no_public_side(self) -> Frontend:
        if self.platform is None:
            return self
        if not NAME_PATTERN.match(self.platform):
            raise ValueError(f"platform {self.platform!r}: a platform's name (lower-case letters, digits and '-')")
        public = sorted({"port", "metrics_port", "tls"} & self.model_fields_set)
        if self.protection.api_keys is not None:
            public.append("protection.api_keys")
        if public:
            raise ValueError(
                f"a stack attached to platform {self.platform!r} has no public side of its own: remove "
                f"{', '.join(public)} (the platform's frontend listens, checks keys and serves TLS)"
            )
        return self

    @property
    def attached(self) -> bool:
        return self.platform is not None

    @model_validator(mode="after")
    def _distinct_ports(self) -> Frontend:
        if self.metrics_port == self.port:
            raise ValueError(f"metrics_port equals port ({self.port}): give HAProxy's metrics another port")
        if self.tls is not None:
            if self.tls.plain_port in (self.port, self.metrics_port):
                raise ValueError(f"tls.plain_port {self.tls.plain_port} is also the frontend's port or metrics_port")
            self.tls.pem()  # a TLSError (a ValueError) names the file that cannot be used
        return self

    def listening_ports(self) -> dict[int, str]:
        """The public ports (none for a stack attached to a platform: its HAProxy picks loopback ports)."""
        return {} if self.attached else listening_ports(self.model_dump(mode="json"))


def listening_ports(frontend: dict[str, Any]) -> dict[int, str]:
    """The ports a frontend section (as a spec's JSON holds it, fields left out taking their defaults) has HAProxy
    listen on, each with the field that asks for it."""
    if frontend.get("platform") is not None:
        return {}
    ports = {
        frontend.get("port", HAPROXY_PORT_DEFAULT): "frontend.port",
        frontend.get("metrics_port", HAPROXY_PROMETHEUS_PORT_DEFAULT): "frontend.metrics_port",
    }
    plain_port = (frontend.get("tls") or {}).get("plain_port")
    if plain_port is not None:
        ports[plain_port] = "frontend.tls.plain_port"
    return ports


class Ingress(Section):
    """Which path serves the stack: `direct` (HAProxy -> replica), `legacy` (the retained Python ingress; a file with
    it is the rollback manifest), or `both`: a canary, `canary_weight` percent of sessions on the direct path, rolled
    back by itself when the direct path breaches an `abort` criterion. `legacy` and `both` deploy the legacy
    ingress."""

    mode: Literal["direct", "legacy", "both"] = "direct"
    """`direct` (HAProxy to the replicas' own ports), `legacy` (the retained Serve ingress: the rollback) or `both` (a
    canary)."""
    canary_weight: int = Field(10, ge=0, le=100)
    """With `both`: the share of sessions (percent) on the direct path."""
    legacy_replicas: int = Field(1, ge=1)
    """Replicas of the legacy ingress app."""
    drain_deadline_s: float = Field(DRAIN_DEADLINE_S_DEFAULT, gt=0)
    """How long a path that lost its traffic may take to finish its streams before they are listed."""
    abort: AbortCriteria = AbortCriteria()
    """When a canary rolls itself back: the thresholds the direct path must stay under."""

    @property
    def retains_legacy(self) -> bool:
        return self.mode != "direct"

    @property
    def direct_weight(self) -> int:
        return {"direct": 100, "legacy": 0, "both": self.canary_weight}[self.mode]

    def config(self) -> IngressConfig:
        return IngressConfig(direct_weight=self.direct_weight, abort=self.abort, drain_deadline_s=self.drain_deadline_s)


class Observability(Section):
    """What the stack tells beyond its metrics: traces across the path (docs/stacks.md, Tracing)."""

    tracing: Tracing = Tracing()
    """Traces of requests across the frontend's route call, the router's decision, the replica and vLLM, sent to an
    OTLP/gRPC receiver (`otlp_endpoint`, `sample_ratio`); off unless `otlp_endpoint` is given."""


EngineArgs = dict[str, EngineArgValue]
