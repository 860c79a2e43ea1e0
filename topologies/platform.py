"""A platform file (`kind: platform`): one frontend for many teams' stacks, its tenants, their keys, quotas, priority
classes and fair shares.

A team stack attaches with `frontend: {platform: <name>}`: its models are added to the platform's running frontend
and removed at `sluice down`, with no reload. A tenant is a team's key list: its keys may call `models` (default:
its own team's attached models); its requests ask for a class (`base.contracts.PRIORITY_HEADER`) no higher than its
`priority`, which is also their default; `weight` is its fair share of a model's capacity within a class. How
admission works and why: services/platform/README.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from base.contracts import PRIORITY_CLASSES
from infra.api_keys import ApiKeySource
from topologies.problems import SpecError, pydantic_problems
from topologies.sections import NAME_PATTERN, Frontend, Section
from topologies.spec import read_spec_data, resolve_relative_paths

NAME = "platform"
# How long a request may wait for a model's capacity before it is refused (429 `queue_timeout`): a stream that
# cannot start within it is better retried than left hanging.
QUEUE_TIMEOUT_S_DEFAULT = 30.0
# Attached models a platform's HAProxy can hold at once (each a backend rendered ahead, filled at run time).
MODEL_SLOTS_DEFAULT = 32

PriorityClass = Literal["interactive", "batch"]
assert PRIORITY_CLASSES == PriorityClass.__args__  # one list of classes: base.contracts


class TenantLimits(Section):
    """A tenant's quotas over all its keys and models (None: none)."""

    max_concurrent_requests: int | None = Field(None, ge=1)
    requests_per_minute: int | None = Field(None, ge=1)
    # Prompt and completion tokens over the last minute, as its replicas report them (streams included).
    tokens_per_minute: int | None = Field(None, ge=1)


class Tenant(Section):
    team: str
    api_keys: ApiKeySource
    # The models its keys may call; None: every model its own team attached.
    models: list[str] | None = None
    priority: PriorityClass = "interactive"
    weight: float = Field(1.0, gt=0, le=100)
    limits: TenantLimits = TenantLimits()

    @field_validator("team")
    @classmethod
    def _identifier(cls, value: str) -> str:
        if not NAME_PATTERN.match(value):
            raise ValueError(f"{value!r}: use lower-case letters, digits and '-' (at most 63, starting alphanumeric)")
        return value

    def may_call(self, model: str, owner_team: str) -> bool:
        return model in self.models if self.models is not None else owner_team == self.team


class Admission(Section):
    queue_timeout_s: float = Field(QUEUE_TIMEOUT_S_DEFAULT, gt=0, le=600)
    model_slots: int = Field(MODEL_SLOTS_DEFAULT, ge=1, le=1024)


class PlatformSpec(Section):
    kind: Literal["platform"]
    name: str
    frontend: Frontend = Frontend()
    tenants: list[Tenant] = Field(min_length=1)
    admission: Admission = Admission()

    @field_validator("name")
    @classmethod
    def _identifier(cls, value: str) -> str:
        if not NAME_PATTERN.match(value):
            raise ValueError(f"{value!r}: use lower-case letters, digits and '-' (at most 63, starting alphanumeric)")
        return value

    @model_validator(mode="after")
    def _one_tenant_per_team(self) -> PlatformSpec:
        if self.frontend.platform is not None:
            raise ValueError("frontend.platform: a platform's frontend is its own; remove `platform`")
        if self.frontend.protection.api_keys is not None:
            raise ValueError("frontend.protection.api_keys: a platform's keys are its tenants' (tenants[].api_keys)")
        if self.frontend.tls is not None:
            raise ValueError("frontend.tls: a platform's frontend does not serve TLS yet: end TLS in front of it")
        if "routers" in self.frontend.model_fields_set:
            raise ValueError("frontend.routers: a platform has no routers (each attached stack has its own)")
        teams = [tenant.team for tenant in self.tenants]
        twice = sorted({team for team in teams if teams.count(team) > 1})
        if twice:
            raise ValueError(f"tenants: one tenant per team ({', '.join(twice)} more than once)")
        return self

    @property
    def stack(self) -> str:
        """The platform's stack name (its registry record, its apps' stem)."""
        return platform_stack(self.name)

    def tenant(self, team: str) -> Tenant | None:
        return next((tenant for tenant in self.tenants if tenant.team == team), None)


def platform_stack(name: str) -> str:
    return f"{name}-{NAME}"


def is_platform_data(data: Any) -> bool:
    return isinstance(data, dict) and data.get("kind") == NAME


def parse_platform(data: Any, folder: Path, where: str = "platform") -> PlatformSpec:
    """A platform from parsed YAML (key files relative to `folder`); raises SpecError with every problem."""
    data = resolve_relative_paths(data, folder)
    for tenant in data.get("tenants") or []:
        keys = tenant.get("api_keys") if isinstance(tenant, dict) else None
        if isinstance(keys, dict) and isinstance(keys.get("file"), str) and not Path(keys["file"]).is_absolute():
            keys["file"] = str((folder / keys["file"]).resolve())
    try:
        return PlatformSpec.model_validate(data)
    except ValidationError as error:
        raise SpecError(where, pydantic_problems(error, [NAME])) from None


def load_platform(path: Path | str) -> PlatformSpec:
    path = Path(path)
    return parse_platform(read_spec_data(path), path.parent, str(path))


def is_platform_file(path: Path | str) -> bool:
    """Whether a spec file is a platform file (a file that cannot be read is not: its loader says why)."""
    try:
        return is_platform_data(read_spec_data(path))
    except SpecError:
        return False
