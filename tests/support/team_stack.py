"""A team file deployed from its plan onto the session's Ray cluster under its own name and ports, for one test
module, and removed after it."""

from __future__ import annotations

import io
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from builders.plan import StackPlan, build_plan
from builders.specs import load_spec
from sluice.deploy.apply import apply_plan, delete_plan, ensure_models
from sluice.deploy.platforms import wait_attached
from tests.support.frontend_contract import register_frontend
from tests.support.ports import free_port

TEAMS = Path(__file__).resolve().parents[2] / "topologies" / "teams"
# A shift that waits covers a drain (the team files' drain deadlines are 60 s at most) and the move itself.
SHIFT_TIMEOUT_S = 180


@dataclass
class TeamStack:
    spec: Any
    plan: StackPlan
    # The spec file as deployed (renamed, own ports).
    path: Path
    url: str

    def shift(self, weight: int, wait: bool = False) -> dict[str, Any]:
        """Move the frontend's direct weight (`wait`: until a path that lost traffic drained); its drain report."""
        return self._frontend().shift.remote(weight, wait).result(timeout_s=SHIFT_TIMEOUT_S)

    def ingress(self) -> dict[str, Any]:
        """The frontend's ingress state: weight, drain, abort."""
        return self._frontend().ingress.remote().result(timeout_s=30)

    def redeploy(self, change: Callable[[dict[str, Any]], None], folder: Path) -> TeamStack:
        """Deploy the stack again, its file changed by `change` (written into `folder`), as `sluice deploy` would;
        the stack as now deployed (same name, same ports: the caller's stack deletes it)."""
        data = yaml.safe_load(self.path.read_text())
        change(data)
        path = folder / "redeployed.yaml"
        path.write_text(yaml.safe_dump(data))
        spec = load_spec(path)
        plan = build_plan(spec)
        _deploy(spec, plan)
        return TeamStack(spec, plan, path, self.url)

    def _frontend(self) -> Any:
        from ray import serve

        return serve.get_app_handle(self.plan.frontend_app)


@contextmanager
def team_stack(
    team_file: str,
    name: str,
    folder: Path,
    staging: bool = False,
    routers: int | None = None,
    ingress: dict[str, Any] | None = None,
    platform: str | None = None,
    team: str | None = None,
    models: dict[str, Any] | None = None,
) -> Iterator[TeamStack]:
    """`staging`: the stack's fault endpoints on; `routers`: that many router replicas instead of the file's;
    `ingress`: the stack's `ingress` section instead of the file's; `platform`: attached to that platform (no port
    of its own; the stack's URL is the platform's), as `team`, its first model's fields updated by `models`."""
    data = yaml.safe_load((TEAMS / team_file).read_text())
    port = free_port()
    data["name"] = name
    data["staging"] = staging or data.get("staging", False)
    if team is not None:
        data["team"] = team
    if models is not None:
        data["models"][0].update(models)
    if platform is None:
        data["frontend"].update(port=port, metrics_port=free_port())
    else:
        data["frontend"] = {"platform": platform, "routers": data["frontend"].get("routers", 1)}
    if routers is not None:
        data["frontend"]["routers"] = routers
    if ingress is not None:
        data["ingress"] = ingress
    path = folder / "stack.yaml"
    path.write_text(yaml.safe_dump(data))
    spec = load_spec(path)
    plan = build_plan(spec)
    ensure_models(spec)
    register_frontend(port)
    try:
        _deploy(spec, plan)
        url = wait_attached(spec) if platform is not None else f"http://127.0.0.1:{port}"
        yield TeamStack(spec, plan, path, url)
    finally:
        # Not awaited: the stack's replicas drain while the next module starts its own (the session's end stops
        # whatever still drains, and checks that nothing is left).
        delete_plan(plan, wait=False)


def _deploy(spec: Any, plan: StackPlan) -> None:
    """Deploy, or fail with deploy's own reason in the message: CI shows a failed fixture's message, not its
    captured output."""
    said = io.StringIO()
    with redirect_stderr(said):
        deployed = apply_plan(spec, plan)
    sys.stderr.write(said.getvalue())
    if not deployed:
        reason = " ".join(said.getvalue().split())
        raise AssertionError(f"{spec.name} did not deploy: {reason[:3000] or 'deploy said nothing'}")
