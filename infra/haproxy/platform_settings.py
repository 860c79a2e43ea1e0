"""PlatformHAProxySettings: everything a platform's HAProxy config and admission Lua depend on, and the names inside
them (services/platform/README.md says what the platform's HAProxy does and why).

A platform's HAProxy sits in front of the attached teams' own HAProxies: it tells a request's tenant from its key,
checks the tenant may call the model, applies the tenant's quotas, then queues the request for the model's capacity
(class first, then the tenant's fair share) and forwards it to the model's team frontend. Models come and go at run
time: each attached model takes one of `model_slots` backends rendered ahead, filled through the runtime API.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from base.contracts import PRIORITY_CLASSES
from infra.haproxy.base_settings import HAProxyBaseSettings

# Names inside the rendered config.
PLATFORM_FRONTEND = "platform_http"
SLOT_BACKEND_PREFIX = "platform_model_"
SLOT_SERVER = "team"
TENANT_TABLE = "platform_tenants"
# Tokens per tenant, added by the replicas' usage reports to `USAGE_FRONTEND` (a rate over `TOKENS_WINDOW_S`).
TOKENS_TABLE = "platform_tokens"
USAGE_FRONTEND = "platform_usage"
TOKENS_WINDOW_S = 60
KEYS_MAP = "keys.map"
ACCESS_MAP = "access.map"
MODELS_MAP = "models.map"
# Slot index -> the model attached there (what the models list walks: a map cannot be listed from Lua).
SLOTS_MAP = "slots.map"
# The access map's key: `<tenant><ACCESS_SEPARATOR><model>` (neither a tenant nor a model name holds it).
ACCESS_SEPARATOR = "|"
PROMETHEUS_FRONTEND = "platform_prometheus"
# Refusals by tenant and reason, keyed `<tenant>/<reason>` (a tenant name holds no '/').
TENANT_REFUSAL_TABLE = "platform_tenant_refusals"
# The Lua admission's names (infra/haproxy/platform_admission.lua.tmpl).
LUA_ADMIT_ACTION = "platform_admit"
LUA_ADMITTED_ACTION = "platform_admitted"
LUA_MODELS_SERVICE = "platform_models"
LUA_METRICS_SERVICE = "platform_metrics"
LUA_UNSERVED_REASON_FETCH = "platform_unserved_reason"
LUA_UNSERVED_BODY_FETCH = "platform_unserved_body"
# Transaction variables the config and the Lua share.
VAR_TENANT = "txn.platform_tenant"
VAR_MODEL = "txn.platform_model"
VAR_ASKED_CLASS = "txn.platform_asked_class"
VAR_ACCESS = "txn.platform_access"
VAR_SLOT = "txn.platform_slot"
VAR_CLASS = "txn.platform_class"
VAR_OFFSET = "txn.platform_offset"
VAR_TAG = "txn.platform_tag"
VAR_CLOCK = "txn.platform_clock"

TENANT_NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"


def slot_backend(slot: int) -> str:
    return f"{SLOT_BACKEND_PREFIX}{slot}"


class TenantRoute(BaseModel):
    """What the platform's HAProxy knows of one tenant (its keys are in the keys map, its models in the access map)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # A team's name (rendered into the config, the Lua and the map keys: no separator of theirs).
    name: str = Field(pattern=TENANT_NAME_PATTERN)
    # Index into base.contracts.PRIORITY_CLASSES: the highest class its requests may ask for, and their default.
    priority_class: int = Field(ge=0, le=len(PRIORITY_CLASSES) - 1)
    weight: float = Field(gt=0)
    max_concurrent_requests: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


class PlatformHAProxySettings(HAProxyBaseSettings):
    platform: str
    tenants: list[TenantRoute] = Field(min_length=1)
    # Where the replicas report a token-quota tenant's tokens (`USAGE_FRONTEND`, on `bind_host`; None: no tenant
    # has a token quota), and the cluster's credential those reports carry (it also lets an attached stack's HAProxy
    # pass the tenant and usage headers on).
    usage_port: int | None = Field(None, ge=1, le=65535)
    internal_credential: SecretStr | None = None
    model_slots: int = Field(ge=1)
    queue_timeout_s: float = Field(gt=0)

    @model_validator(mode="after")
    def _keys_are_the_tenants(self) -> PlatformHAProxySettings:
        if self.protection.api_keys is not None:
            raise ValueError("protection.api_keys: a platform's keys are its tenants' (the keys map)")
        return self

    @property
    def lua_path(self) -> Path:
        return self.workdir / "platform_admission.lua"

    @property
    def listener_sockets(self) -> tuple[Path, ...]:
        return (self.socket_path,)

    def map_path(self, name: str) -> Path:
        return self.workdir / name
