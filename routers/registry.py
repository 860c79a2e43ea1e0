"""Every routing policy by name: its settings model, factory, Serve adapter and capabilities (`PolicyEntry`).

Spec validation, the router service, the builders and the Serve adapters ask this module; nothing outside
`routers/` names a policy. Adding a policy is one module (NAME, settings, policy class, ENTRY) plus one line in
`BUILT_IN` (routers/README.md#adding-a-policy).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler, ValidationError
from pydantic_core import PydanticCustomError, core_schema

from base.named_registry import NamedRegistry
from routers import capacity_queue, consistent_hash, kv_aware, power_of_two, round_robin
from routers.core import RoutingPolicy
from routers.entry import PolicyContext, PolicyEntry, PolicySettings

BUILT_IN: tuple[PolicyEntry, ...] = (
    round_robin.ENTRY,
    power_of_two.ENTRY,
    consistent_hash.ENTRY,
    capacity_queue.ENTRY,
    kv_aware.ENTRY,
)
# A stack's (and a router's) policy when none is set, and the prefill side's of prefill/decode.
DEFAULT_POLICY = round_robin.NAME
DEFAULT_PREFILL_POLICY = power_of_two.NAME
# Where a policy that reads the prompt cannot run (DeploymentHandle calls carry no body to tokenize): by load.
HANDLE_POLICY_WITHOUT_PROMPT = power_of_two.NAME


class PolicyConfigError(ValueError):
    """Unknown policy or invalid kwargs, with every problem spelled out."""


_POLICIES: NamedRegistry[PolicyEntry] = NamedRegistry("routing policy", PolicyConfigError, BUILT_IN)
# Make an entry known by its name (a name already taken is refused); forget one (tests that registered one).
register_policy = _POLICIES.register
unregister_policy = _POLICIES.unregister
policy_entry = _POLICIES.named
# Every registered policy, in registration order.
policy_names = _POLICIES.names


def prefill_policy_choices() -> str:
    """The policies that may choose a prefill replica, for a message: `power_of_two, round_robin or ...`."""
    others = [entry.name for entry in _POLICIES.items() if entry.prefill_side and entry.name != DEFAULT_PREFILL_POLICY]
    return _one_of([DEFAULT_PREFILL_POLICY, *others])


def _one_of(names: list[str]) -> str:
    """`a, b or c`."""
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]


def validate_settings(policy: str, kwargs: dict[str, Any]) -> PolicySettings:
    """The policy's settings from `kwargs`; raises `PolicyConfigError` naming every problem."""
    entry = policy_entry(policy)
    try:
        return entry.settings.model_validate(kwargs)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'kwargs'}: {e['msg']}" for e in error.errors())
        raise PolicyConfigError(f"invalid {policy} kwargs: {problems}") from None


def build_policy(policy: str, kwargs: dict[str, Any], context: PolicyContext | None = None) -> RoutingPolicy:
    """The pure-core policy `policy` with `kwargs`, for the app and deployment of `context`."""
    settings = validate_settings(policy, kwargs)
    return policy_entry(policy).build(settings, context or PolicyContext())


def table_of(policy: str, kwargs: dict[str, Any]) -> tuple[str, int] | None:
    """(table kind, fallbacks) when the frontend can decide for `policy` with `kwargs` from a router's table, else
    None."""
    return policy_entry(policy).table(validate_settings(policy, kwargs))


def table_policy_choices() -> str:
    """The policies the frontend can decide from a table with their default kwargs, for a message: `a or b`."""
    return _one_of([entry.name for entry in _POLICIES.items() if entry.table(entry.settings()) is not None])


def handle_policy(policy: str, kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The policy (and kwargs) DeploymentHandle calls to a deployment routed by `policy` use."""
    if policy_entry(policy).needs_prompt:
        return HANDLE_POLICY_WITHOUT_PROMPT, {}
    return policy, kwargs


def build_stateless_policy(policy: str, kwargs: dict[str, Any]) -> RoutingPolicy:
    """A policy that needs no capacity ledger; one that does is refused."""
    settings = validate_settings(policy, kwargs)
    entry = policy_entry(policy)
    if entry.needs_ledger:
        raise PolicyConfigError(f"{policy} needs a capacity ledger")
    return entry.build(settings, PolicyContext())


class _KnownPolicy:
    """A spec's policy field: a registered name (checked at validation time, so a policy registered later counts);
    its JSON Schema is an enum of the registered names."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(_known, core_schema.str_schema())

    @classmethod
    def __get_pydantic_json_schema__(
        cls, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> dict[str, Any]:
        return {"enum": policy_names(), "type": "string"}


def _known(name: str) -> str:
    if name not in policy_names():
        # The error of a Literal of the names, as the spec's field was before the registry.
        expected = _one_of([repr(n) for n in policy_names()])
        raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})
    return name


PolicyName = Annotated[str, _KnownPolicy]
