"""`sluice canary | rollback`: move a deployed stack's traffic between the direct path and the legacy ingress.

Both talk to the stack's frontend replica (`services.frontend.app`): the weight changes at once, without a reload;
a move that takes all traffic off a path waits for that path's streams to finish (drain, up to the spec's
`ingress.drain_deadline_s`) and lists those still running at the deadline. `canary --watch S` then follows both
paths' measures for S seconds and exits 1 if the guard rolled the canary back, naming the criterion.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from base.contracts import DIRECT_WEIGHT_MAX
from base.waiting import WaitTimeout, wait_until
from services.frontend.ingress_control import LEGACY_WAIT_S, NoLegacyPath
from sluice.deploy.apply import plan_of
from sluice.deploy.exit_codes import EXIT_FAILED
from sluice.deploy.preflight import connect_to_serve

if TYPE_CHECKING:
    from builders.plan import StackPlan

WATCH_POLL_S = 2.0


def measures_lines(ingress: dict[str, Any]) -> list[str]:
    """Both paths' measures per app, side by side."""
    lines = []
    for app in ingress["measures"]:
        parts = []
        for path in ("direct", "legacy"):
            m = app[path]
            parts.append(
                f"{path} {m['requests']} req, 503 {m['ratio_503']:.1%}, TTFT p99 {m['ttft_p99_s']:.3f} s, "
                f"stream errors {m['stream_error_ratio']:.1%}, imbalance {m['replica_imbalance']:.2f}"
            )
        lines.append(f"  {app['app']}: " + " | ".join(parts))
    return lines


def drain_lines(drain: dict[str, Any] | None) -> list[str]:
    if drain is None:
        return []
    if drain["done"]:
        return [f"  the {drain['path']} path drained in {drain['waited_s']:.1f} s: it may be torn down"]
    running = ", ".join(f"{server} ({streams})" for server, streams in sorted(drain["still_running"].items()))
    if running:
        return [f"  the {drain['path']} path still had streams at the deadline ({drain['waited_s']:.0f} s): {running}"]
    return [f"  the {drain['path']} path is draining ({drain['waited_s']:.1f} s so far)"]


def abort_line(abort: dict[str, Any]) -> str:
    breach = abort["breach"]
    return (
        f"canary ROLLED BACK from weight {abort['weight_before']}: {abort['app']}: {breach['criterion']} on the "
        f"direct path was {breach['value']:.3f} over the threshold {breach['threshold']:.3f}"
    )


def _frontend(plan: StackPlan) -> Any:
    from ray import serve

    return serve.get_app_handle(plan.frontend_app)


def move(path: str, address: str, weight: int) -> tuple[Any, dict[str, Any]]:
    """Set the stack's direct weight and wait for any drain; (spec, the frontend's ingress status)."""
    spec, plan = plan_of(path)
    if weight < DIRECT_WEIGHT_MAX and not any(model.legacy_deployed for model in plan.models):
        raise NoLegacyPath(
            f"{path} retains no legacy path (ingress.mode {spec.ingress.mode}): deploy it with ingress.mode both "
            "(or legacy) before moving traffic there"
        )
    connect_to_serve(address)
    timeout = spec.ingress.drain_deadline_s + LEGACY_WAIT_S + 30
    return spec, _frontend(plan).shift.remote(weight, True).result(timeout_s=timeout)


def canary(path: str, address: str, weight: int, watch_s: float) -> int:
    spec, ingress = move(path, address, weight)
    print(
        f"direct weight {ingress['direct_weight']}%: {DIRECT_WEIGHT_MAX - ingress['direct_weight']}% of sessions "
        "on the legacy path"
    )
    print("\n".join(drain_lines(ingress["drain"])))
    _, plan = plan_of(path)

    def aborted() -> dict[str, Any] | None:
        time.sleep(WATCH_POLL_S)
        ingress = _frontend(plan).ingress.remote().result(timeout_s=30)
        print("\n".join(measures_lines(ingress)), flush=True)
        return ingress["abort"]

    try:
        abort = wait_until(watch_s, aborted, "the canary to roll back", poll_s=0)
    except WaitTimeout:
        return 0
    print(abort_line(abort))
    return EXIT_FAILED


def rollback(path: str, address: str) -> int:
    _, ingress = move(path, address, 0)
    print("direct weight 0%: every new request goes to the legacy path")
    print("\n".join(drain_lines(ingress["drain"])))
    drain = ingress["drain"]
    return 0 if drain is None or drain["done"] else 1
