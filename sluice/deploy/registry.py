"""The sluice stacks deployed on a cluster, as they were deployed.

`sluice deploy` and `sluice serve` record each stack in Ray's GCS key-value store: the spec as deployed (with
`sluice serve`'s flags applied), the file it came from and the stack's Serve apps. `sluice status` with no argument
lists them, `sluice status STACK` and `sluice down STACK` work without the file, and `status FILE` says where the
file and the running stack differ. The record lives as long as the cluster; `down` removes it.

A redeploy is recorded once it succeeded: while it runs (and after it failed) the record keeps the spec that ran
before, with the new plan's apps added to its apps, so `down` deletes whatever the redeploy started; once it
succeeded, the apps the new plan no longer has (a model renamed or dropped, a stack going from one model to several)
are deleted (`retired_apps`).
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict

from builders.plan import StackPlan
from topologies.platform import PlatformSpec
from topologies.spec import StackBase

KEY_PREFIX = "sluice/stack/"


class DeployedStack(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stack: str
    source: str
    spec: dict[str, Any]
    apps: list[str]
    deployed_at: float


def record(spec: StackBase | PlatformSpec, plan: StackPlan, source: str) -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    entry = DeployedStack(
        stack=plan.stack,
        source=source,
        spec=spec.model_dump(mode="json"),
        apps=[app.name for app in plan.apps],
        deployed_at=time.time(),
    )
    _internal_kv_put(KEY_PREFIX + plan.stack, entry.model_dump_json(), overwrite=True)


def deployed(stack: str) -> DeployedStack | None:
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(KEY_PREFIX + stack)
    return DeployedStack.model_validate_json(raw) if raw is not None else None


def deployed_stacks() -> list[DeployedStack]:
    from ray.experimental.internal_kv import _internal_kv_list

    names = sorted(key.decode().removeprefix(KEY_PREFIX) for key in _internal_kv_list(KEY_PREFIX))
    return [entry for name in names if (entry := deployed(name)) is not None]


def forget(stack: str) -> None:
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(KEY_PREFIX + stack)


def add_apps(stack: str, apps: list[str]) -> None:
    """Add apps to a stack's record, its spec kept (a redeploy under way)."""
    from ray.experimental.internal_kv import _internal_kv_put

    entry = deployed(stack)
    if entry is not None:
        entry.apps += [app for app in apps if app not in entry.apps]
        _internal_kv_put(KEY_PREFIX + stack, entry.model_dump_json(), overwrite=True)


def retired_apps(previous: DeployedStack | None, plan: StackPlan) -> list[str]:
    """The apps a stack's earlier deploy started that its new plan no longer has."""
    planned = {app.name for app in plan.apps}
    return [app for app in previous.apps if app not in planned] if previous is not None else []
