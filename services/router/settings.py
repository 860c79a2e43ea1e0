"""What one router app routes to and how (`RouterSettings`, the args of its Serve app), and the policies it builds.

The policy and its kwargs are checked against the policy's own settings in `routers.registry`; the prefill side of
prefill/decode takes only a policy the registry allows there. Fields and defaults: services/router/README.md.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from base.contracts import DEFAULT_MAX_ONGOING_REQUESTS, SESSION_HEADER_DEFAULT, NodeRole
from base.tracing import Tracing
from routers.capacity_ledger import LedgerClient
from routers.core import InFlightTracker, RoutingPolicy
from routers.entry import PolicyContext
from routers.registry import (
    DEFAULT_POLICY,
    DEFAULT_PREFILL_POLICY,
    build_stateless_policy,
    policy_entry,
    policy_names,
    prefill_policy_choices,
    validate_settings,
)
from routers.registry import build_policy as build_registered_policy
from routers.shadows import ShadowPolicies, shadow_refusal
from services.replica.llm_config import LLM_DEPLOYMENT_NAME


class PolicyChoice(BaseModel):
    """A routing policy and its kwargs, checked against the policy's own settings."""

    model_config = ConfigDict(extra="forbid")

    policy: str = DEFAULT_POLICY
    policy_kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _policy_kwargs(self) -> PolicyChoice:
        # PolicyConfigError is a ValueError: pydantic reports its message as the validation error.
        validate_settings(self.policy, self.policy_kwargs)
        return self


class PrefillTarget(PolicyChoice):
    """Prefill/decode: the prefill app a router also chooses from for every request, with its own policy."""

    app: str = Field(min_length=1)
    # The prefill app's route prefix: its replicas serve vLLM's paths under it.
    route_prefix: str = ""
    deployment: str = LLM_DEPLOYMENT_NAME
    capacity: int = Field(DEFAULT_MAX_ONGOING_REQUESTS, ge=1)
    policy: str = DEFAULT_PREFILL_POLICY
    # False when the decode replicas prefill locally if need be: with no prefill replica the decode side is
    # routed anyway (and the decode replica says it prefilled locally) instead of a 503 `no_prefill_replica`.
    required: bool = True

    @field_validator("policy")
    @classmethod
    def _prefill_side(cls, value: str) -> str:
        # An unknown name is left to `_policy_kwargs`, which names the known ones.
        if value in policy_names() and not policy_entry(value).prefill_side:
            raise ValueError(f"{policy_entry(value).prefill_refusal}: choose {prefill_policy_choices()}")
        return value


class RouterSettings(PolicyChoice):
    """What one router app routes to and how."""

    target_app: str = Field(min_length=1)
    target_deployment: str = LLM_DEPLOYMENT_NAME
    # The target deployment's `max_ongoing_requests`: each replica's capacity in the views.
    target_capacity: int = Field(DEFAULT_MAX_ONGOING_REQUESTS, ge=1)
    session_header: str = SESSION_HEADER_DEFAULT
    refresh_interval_s: float = Field(0.25, gt=0)
    # How long the tracker counts a decision as in flight (the router never sees completions).
    forget_after_s: float = Field(2.0, gt=0)
    # Prefill/decode: the prefill side, chosen with the decode replica.
    prefill: PrefillTarget | None = None
    # In-engine data parallelism: each target replica runs this many engine ranks, ranked as `<replica>:<rank>`.
    data_parallel_size: int = Field(1, ge=1)
    # Staging stacks only: `POST <prefix>/internal/fault {"seconds": s}` makes every route call fail for s seconds.
    fault_injection: bool = False
    # The served model's files (its tokenizer and chat template), for a policy that reads the prompt's tokens.
    model_path: str | None = None
    # The target app's route prefix: where its replicas answer `KV_EVENTS_PATH` (a policy fed by KV events).
    target_route_prefix: str = ""
    # Policies that rank every request beside the live one, scored on what they would have cached
    # (`routers.shadows`); they need the served model's files (`model_path`) and the replicas' KV events.
    shadow_policies: list[str] = Field(default_factory=list)
    # How long HAProxy waits for the route agent's answer (SPOE's processing timeout): a decision still pending then
    # is cancelled, so a capacity wait gives its grant back instead of holding a token no request carries. None: no
    # bound (a router no frontend's agent calls).
    agent_deadline_s: float | None = Field(None, gt=0)
    # Each decision a span (`services.router.route_span`), sent to the stack's OTLP receiver; off by default.
    tracing: Tracing = Tracing()

    @field_validator("session_header")
    @classmethod
    def _header_name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9-]+", value):
            raise ValueError(f"invalid header name {value!r}")
        return value.lower()

    @model_validator(mode="after")
    def _prompt_source(self) -> RouterSettings:
        if policy_entry(self.policy).needs_prompt and self.model_path is None:
            raise ValueError(f"{self.policy} reads the prompt's tokens: give model_path (the served model's files)")
        if self.shadow_policies and self.model_path is None:
            raise ValueError("shadow policies are scored on the prompt's tokens: give model_path")
        return self

    @field_validator("shadow_policies")
    @classmethod
    def _shadowable(cls, names: list[str]) -> list[str]:
        for name in names:
            if name not in policy_names():
                raise ValueError(f"unknown shadow policy {name!r}: one of {', '.join(policy_names())}")
            entry = policy_entry(name)
            refusal = shadow_refusal(entry.needs_prompt, entry.needs_ledger)
            if refusal is not None:
                raise ValueError(f"{name} cannot shadow: it {refusal}")
        if len(set(names)) != len(names):
            raise ValueError("a shadow policy is named twice")
        return names


class RouterAppArgs(BaseModel):
    """What `build_router_application` takes from a Serve config's `args`."""

    model_config = ConfigDict(extra="forbid")

    settings: RouterSettings
    num_replicas: int = Field(1, ge=1)
    # A stack across nodes runs its routers on the head node; None: one machine.
    node_role: NodeRole | None = None


def build_policy(settings: RouterSettings, ledger: LedgerClient | None = None) -> RoutingPolicy:
    """The policy the settings name. One that needs a capacity ledger uses `ledger`, else the target deployment's
    ledger actor."""
    tokenize = None
    if policy_entry(settings.policy).needs_prompt and settings.model_path is not None:
        from routers.prompt_tokens import PromptTokens

        tokenize = PromptTokens(settings.model_path)
    context = PolicyContext(
        app=settings.target_app, deployment=settings.target_deployment, ledger=ledger, tokenize=tokenize
    )
    policy = build_registered_policy(settings.policy, settings.policy_kwargs, context)
    policy.tracker = InFlightTracker(forget_after_s=settings.forget_after_s)
    return policy


def build_shadows(settings: RouterSettings) -> ShadowPolicies | None:
    """The settings' shadow policies (None: none), each built with its default kwargs."""
    if not settings.shadow_policies or settings.model_path is None:
        return None
    from routers.prompt_tokens import PromptTokens

    shadows = {}
    for name in settings.shadow_policies:
        policy = build_stateless_policy(name, {})
        policy.tracker = InFlightTracker(forget_after_s=settings.forget_after_s)
        shadows[name] = policy
    return ShadowPolicies(settings.policy, shadows, PromptTokens(settings.model_path))


def build_prefill_policy(settings: RouterSettings, side: PrefillTarget) -> RoutingPolicy:
    """The prefill side's policy (never one with capacity tokens)."""
    policy = build_stateless_policy(side.policy, side.policy_kwargs)
    policy.tracker = InFlightTracker(forget_after_s=settings.forget_after_s)
    return policy
