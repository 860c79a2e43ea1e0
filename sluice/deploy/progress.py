"""What `sluice deploy` (and `sluice serve`) shows while a stack starts, and what it says when the start fails.

Each deployment's replicas by state are shown when they change (quiet otherwise). A deployment that Serve gave up on
(DEPLOY_FAILED: its constructor failed every retry) ends the wait at once; at the deadline every deployment not yet
HEALTHY is named. Either way the report says what Serve says of it and the last lines of its replica's log, where
a replica says what it waits for (`base.waiting`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

LOG_TAIL_LINES = 12
# Right after a redeploy Serve may still report the previous deploy's DEPLOY_FAILED: it counts only once the
# deployment was seen trying again, or after this long (a redeploy of the same failing version is not retried).
STALE_FAILURE_S = 5.0


def _replicas(states: dict) -> str:
    counts = {getattr(state, "value", str(state)).lower(): n for state, n in states.items() if n}
    running = counts.pop("running", 0)
    rest = "".join(f", {n} {state}" for state, n in sorted(counts.items()))
    return f"{running} running{rest}"


class DeployProgress:
    """The apps' deployments as Serve reports them, shown through `say` when they change."""

    def __init__(self, apps: list[str], say: Callable[[str], None]) -> None:
        self._apps = apps
        self._say = say
        self._shown: dict[tuple[str, str], tuple[str, str]] = {}
        self._since = time.monotonic()
        self._retried: set[tuple[str, str]] = set()

    def _deployments(self) -> list[tuple[str, str, object]]:
        from ray import serve

        applications = serve.status().applications
        found = []
        for app in self._apps:
            status = applications.get(app)
            for name, deployment in (status.deployments if status is not None else {}).items():
                found.append((app, name, deployment))
        return found

    def poll(self) -> str | None:
        """Show what changed; the report of a deployment Serve gave up on (None: none did)."""
        for app, name, deployment in self._deployments():
            state = deployment.status.value  # type: ignore[attr-defined]
            shown = (state, _replicas(deployment.replica_states))  # type: ignore[attr-defined]
            if self._shown.get((app, name)) != shown:
                self._shown[(app, name)] = shown
                self._say(f"{app}/{name}: {shown[1]} ({state.lower()})")
            if state != "DEPLOY_FAILED":
                self._retried.add((app, name))
            elif (app, name) in self._retried or time.monotonic() - self._since > STALE_FAILURE_S:
                return report(app, name, deployment.message)  # type: ignore[attr-defined]
        return None

    def stuck(self) -> list[str]:
        """The report of every deployment not HEALTHY yet."""
        return [
            report(app, name, deployment.message)  # type: ignore[attr-defined]
            for app, name, deployment in self._deployments()
            if deployment.status.value != "HEALTHY"  # type: ignore[attr-defined]
        ]


def _gist(message: str) -> str:
    """Serve's message without the traceback it may carry: its first line and the exception's."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    if len(lines) <= 2:
        return " ".join(lines)
    return f"{lines[0]} ... {lines[-1].strip()}"


def report(app: str, deployment: str, message: str) -> str:
    from services.serve_internals import replica_log_tail

    where, lines = replica_log_tail(app, deployment, LOG_TAIL_LINES)
    said = _gist(message) or "Serve gives no message"
    tail = "".join(f"\n    | {line}" for line in lines) if lines else f"\n    (no replica log of it here: {where})"
    return f"{app}/{deployment}: {said}\n  last lines of its replica log ({where}):{tail}"
