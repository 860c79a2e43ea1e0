"""What a plan is made of: Serve applications (each named by its builder's import path and args) and what the plan
says of each served model (its apps, its HAProxy backends, its policies); docs/design.md §2.2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from base.runtime import default_model_dir, default_moe_model_dir
from topologies.spec import TINY_MOE_SOURCE, TINY_SOURCE


class ServeApp(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    route_prefix: str | None
    import_path: str
    args: dict[str, Any]


class PlannedModel(BaseModel):
    """One served model of a plan: its Serve apps, its HAProxy backends and its policies."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    # The app whose replicas HAProxy pins requests to (the decode app of a prefill/decode model).
    llm_app: str
    router_app: str
    replica_backend: str
    router_backend: str
    policy: str
    # Replicas the stack waits for and expects (the fixed count, or the autoscaling minimum; gangs x ranks).
    min_replicas: int
    routers: int
    # Prefill/decode: the prefill app and its policy.
    prefill_app: str | None = None
    prefill_policy: str | None = None
    prefill_replicas: int = 0
    # Data parallel: `in_engine` or `ranks`, and the ranks per replica (or per gang).
    data_parallel: str | None = None
    data_parallel_size: int = 1
    # The model's legacy ingress app (None: no legacy path), and whether the plan deploys it.
    legacy_app: str | None = None
    legacy_deployed: bool = False
    # What each of the model's LLM apps is, as its kind describes it for `sluice status`.
    app_roles: dict[str, str] = Field(default_factory=dict)


class StackPlan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    stack: str
    apps: list[ServeApp]
    models: list[PlannedModel]
    url: str

    @property
    def frontend_app(self) -> str:
        return self.apps[-1].name


def import_path(builder: Callable[..., Any]) -> str:
    return f"{builder.__module__}:{builder.__name__}"


def model_path(source: str) -> str:
    """Where a model's weights are: the tiny model's folder for `tiny`, else the source as vLLM takes it."""
    local = {TINY_SOURCE: default_model_dir, TINY_MOE_SOURCE: default_moe_model_dir}
    return str(local[source]()) if source in local else source
