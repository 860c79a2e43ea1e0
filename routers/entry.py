"""What a policy module hands the registry: its name, settings model, factory and capabilities.

Every policy module defines `NAME`, a `PolicySettings` subclass and `ENTRY = PolicyEntry(...)`; `routers.registry`
lists the entries. No Ray import: the Serve adapter is named by its import path (`PolicyEntry.adapter`).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from routers.core import RoutingPolicy

if TYPE_CHECKING:
    from routers.capacity_ledger import LedgerClient
    from routers.kv_events import KVEventTarget
    from routers.prompt_tokens import Tokenize

# A policy's name is a metric label, a spec value and (camel-cased) its Serve adapter's class name.
NAME_PATTERN = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")
ADAPTERS_MODULE = "routers.serve_adapters"


class PolicySettings(BaseModel):
    """A policy's kwargs, validated before anything is deployed; unknown keys are refused."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """Where a policy is built: the app and deployment it routes to; `ledger` replaces the deployment's ledger actor
    (tests, benches) for a policy that needs one."""

    app: str = ""
    deployment: str = ""
    ledger: LedgerClient | None = None
    # The served model's prompt tokens of a forwarded body (`routers.prompt_tokens`), for a policy that needs them.
    tokenize: Tokenize | None = None


def _reads_no_body(settings: Any) -> tuple[str, str] | None:
    return None


def _no_table(settings: Any) -> tuple[str, int] | None:
    return None


@dataclass(frozen=True)
class PolicyReport:
    """A running policy's own state for operators: the router's `describe` gives it under `key`, `sluice status`
    prints it as `lines` say, and the router serves it at `path` (the internal credential required)."""

    key: str
    path: str
    build: Callable[[Any], dict[str, Any]]
    lines: Callable[[dict[str, Any]], list[str]]


def adapter_class_name(policy: str) -> str:
    """`consistent_hash` -> `ConsistentHashRequestRouter`."""
    return "".join(part.title() for part in policy.split("_")) + "RequestRouter"


@dataclass(frozen=True)
class PolicyEntry:
    """One routing policy as the rest of sluice sees it."""

    name: str
    settings: type[PolicySettings]
    # The pure-core policy from validated settings (an instance of `settings`) and where it runs.
    build: Callable[[Any, PolicyContext], RoutingPolicy]
    # Takes a capacity token per request from the deployment's ledger: the replicas must release them, and the
    # policy cannot be built without a ledger (`build_stateless_policy` refuses it).
    needs_ledger: bool = False
    # May choose the prefill replica of a prefill/decode model. A policy with capacity tokens may not: a token is
    # released by the replica it was taken for, and the decode replica's prefill call carries none. Nor may one fed
    # by KV events: the router follows the decode replicas' events only.
    prefill_side: bool = True
    # (kwarg, what it reads) when these settings read the forwarded request body (the app must set forward_body);
    # kwarg "policy" when the policy reads it whatever its settings.
    body_use: Callable[[Any], tuple[str, str] | None] = _reads_no_body
    # Reads the prompt's tokens: the router loads the served model's tokenizer and chat template (`PolicyContext`).
    # The handle path (the legacy ingress's calls) has no prompt to give it: it routes by `HANDLE_POLICY` instead.
    needs_prompt: bool = False
    # What the router service does for a running policy, so that nothing outside routers/ names a policy class:
    # the target its KV event subscriber feeds, for a policy scored by its engines' KV events (the replicas then
    # publish them: vLLM's `--kv-events-config`);
    kv_event_target: Callable[[Any], KVEventTarget] | None = None
    # its own state for operators;
    report: PolicyReport | None = None
    # what it refreshes (its gauges, labelled by the target app) before the router's /metrics is read.
    refresh_metrics: Callable[[Any, str], Awaitable[None]] | None = None
    # (table kind, fallbacks per decision) when these settings make each decision a function of the replica set and
    # the request's headers alone: the frontend can then decide from the router's table (`base.route_wire.RouteTable`).
    table: Callable[[Any], tuple[str, int] | None] = _no_table

    @property
    def kv_events(self) -> bool:
        """Scores replicas by their engines' KV events: the replicas must publish them."""
        return self.kv_event_target is not None

    @property
    def prefill_refusal(self) -> str:
        """Why this policy may not choose the prefill replica (for a policy that may not)."""
        if self.needs_ledger:
            return "the prefill side takes no capacity tokens (the decode replica calls it)"
        return f"the prefill side cannot run {self.name} (the router follows the decode replicas' KV events only)"

    def __post_init__(self) -> None:
        if not NAME_PATTERN.match(self.name):
            raise ValueError(f"policy name {self.name!r}: lower-case words joined by underscores")

    @property
    def adapter(self) -> str:
        """The import path of its Ray Serve `RequestRouter` (what `RequestRouterConfig` keeps)."""
        return f"{ADAPTERS_MODULE}.{adapter_class_name(self.name)}"
