"""Validated settings of each policy: the kwargs a deployment's `RequestRouterConfig` may carry."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from routers.capacity_ledger import DEFAULT_TOKEN_TTL_S
from routers.capacity_queue import DEFAULT_MAX_WAIT_S
from routers.consistent_hash import ConsistentHash
from routers.core import DEFAULT_NUM_FALLBACK_REPLICAS, RoutingPolicy
from routers.power_of_two import PowerOfTwo
from routers.round_robin import RoundRobin

PolicyName = Literal["round_robin", "power_of_two", "consistent_hash", "capacity_queue"]


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RoundRobinSettings(_Settings):
    pass


class PowerOfTwoSettings(_Settings):
    seed: int | None = None


class ConsistentHashSettings(_Settings):
    num_fallback_replicas: int = Field(DEFAULT_NUM_FALLBACK_REPLICAS, ge=0)
    load_factor: float | None = Field(None, ge=1.0)
    user_affinity: bool = False


class CapacityQueueSettings(_Settings):
    max_wait_s: float = Field(DEFAULT_MAX_WAIT_S, gt=0)
    token_ttl_s: float = Field(DEFAULT_TOKEN_TTL_S, gt=0)
    seed: int | None = None


SETTINGS: dict[str, type[_Settings]] = {
    "round_robin": RoundRobinSettings,
    "power_of_two": PowerOfTwoSettings,
    "consistent_hash": ConsistentHashSettings,
    "capacity_queue": CapacityQueueSettings,
}


class PolicyConfigError(ValueError):
    """Unknown policy or invalid kwargs, with every problem spelled out."""


def validate_settings(policy: str, kwargs: dict) -> _Settings:
    if policy not in SETTINGS:
        raise PolicyConfigError(f"unknown routing policy {policy!r}; choose one of {sorted(SETTINGS)}")
    try:
        return SETTINGS[policy].model_validate(kwargs)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'kwargs'}: {e['msg']}" for e in error.errors())
        raise PolicyConfigError(f"invalid {policy} kwargs: {problems}") from None


def build_stateless_policy(policy: str, kwargs: dict) -> RoutingPolicy:
    """A policy that needs no external ledger (all but capacity_queue)."""
    settings = validate_settings(policy, kwargs)
    if isinstance(settings, RoundRobinSettings):
        return RoundRobin()
    if isinstance(settings, PowerOfTwoSettings):
        return PowerOfTwo(seed=settings.seed)
    if isinstance(settings, ConsistentHashSettings):
        return ConsistentHash(
            num_fallback_replicas=settings.num_fallback_replicas,
            load_factor=settings.load_factor,
            user_affinity=settings.user_affinity,
        )
    raise PolicyConfigError(f"{policy} needs a capacity ledger")
