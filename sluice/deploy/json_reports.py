"""What the `--json` outputs print, as objects a tool can read without parsing prose. `sluice status`: the stack's
state as an enum with its reasons, each replica as `{id, host, port, rank}`, the canary as a state (`StackList` with
no argument, `StatusReport` for one stack). `sluice check`: the verdict, the failed and skipped items, every item
(`CheckReport`). Their JSON schemas: `status_schema()`, `check_schema()`; the tests validate live output against them.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter

from sluice.deploy.orphans import OrphanProcess


class _Report(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StackState(StrEnum):
    READY = "ready"
    DEGRADED = "degraded"  # `reasons` says why


class CanaryState(StrEnum):
    NONE = "none"  # every session on one path, nothing rolled back
    RUNNING = "running"  # a share of the sessions on the direct path
    ROLLED_BACK = "rolled_back"  # the guard put every session back on the legacy path by itself


class ReplicaEntry(_Report):
    id: str
    host: str
    port: int
    # A `ranks` data-parallel replica's engine rank; None for other replicas and for one that did not answer.
    rank: int | None = None


class AppEntry(_Report):
    role: str
    status: str  # Serve's application status, or NOT_DEPLOYED
    replicas: list[ReplicaEntry]


class ModelEntry(_Report):
    # What the model's running routers report (policy, kwargs, KV events); None: no router answered.
    routers: dict[str, Any] | None
    planned_policy: str


class PrefillPair(_Report):
    decode: str
    prefill: str
    outcome: str
    requests: float


class CanaryEntry(_Report):
    state: CanaryState
    direct_weight: int | None  # None: the frontend did not answer
    summary: str | None  # the same in words (`sluice status` prints it)


class StatusReport(_Report):
    stack: str
    described_from: str
    state: StackState
    reasons: list[str]
    differences: list[str]
    apps: dict[str, AppEntry]
    models: dict[str, ModelEntry]
    pairs: dict[str, list[PrefillPair]]
    # The frontend's own report (HAProxy's PIDs, servers and weights); None: it did not answer.
    frontend: dict[str, Any] | None
    ingress: dict[str, Any]
    canary: CanaryEntry


class StackEntry(_Report):
    stack: str
    source: str
    deployed_at: float
    apps: dict[str, str]  # app -> Serve's status, or NOT_DEPLOYED


class StackList(_Report):
    stacks: list[StackEntry]
    # Engines and HAProxies on the node `sluice status` ran on whose replica has ended (`sluice.deploy.orphans`).
    orphans: list[OrphanProcess] = []


class Verdict(StrEnum):
    PASS = "pass"  # exit 0
    INCOMPLETE = "incomplete"  # an item skipped and not allowed: exit 4
    FAIL = "fail"  # exit 1


class CheckItem(_Report):
    item: str
    ok: bool | None  # None: skipped
    detail: str  # a skipped item: why
    enable_with: str | None  # a skipped item: the flag or spec setting that runs it
    allowed: bool  # a skipped item the user accepted (`--allow-skip`)


class SkippedItem(_Report):
    item: str
    reason: str
    enable_with: str | None
    allowed: bool


class CheckReport(_Report):
    verdict: Verdict
    failed: list[str]
    skipped: list[SkippedItem]
    items: list[CheckItem]


def canary_state(ingress: dict[str, Any] | None) -> CanaryState:
    if ingress is None:
        return CanaryState.NONE
    if ingress.get("abort") is not None:
        return CanaryState.ROLLED_BACK
    return CanaryState.RUNNING if 0 < ingress["direct_weight"] < 100 else CanaryState.NONE


def status_schema() -> dict[str, Any]:
    """The JSON schema of `sluice status --json`: one stack's report, or the list of stacks."""
    return TypeAdapter(StatusReport | StackList).json_schema()


def check_schema() -> dict[str, Any]:
    """The JSON schema of `sluice check --json`."""
    return CheckReport.model_json_schema()
