"""The one place sluice touches Ray and Ray Serve private APIs (Ray 2.60): a Ray upgrade edits this file.

A pinned deployment version (`with_rollout_version`) lets a redeploy that changes only `num_replicas`
scale in place: without it Serve gives every `serve.run` a random version and rolls every replica.

Replica endpoint discovery asks the Serve controller for the direct-ingress target groups of an
application. The controller lists only RUNNING replicas whose port is allocated, so a stopping
replica disappears at once and a replaced replica shows up with its new port.
"""

from __future__ import annotations

import asyncio

import ray
from pydantic import BaseModel, ConfigDict
from ray._private import ray_constants
from ray.serve._private.common import REPLICA_ID_FULL_ID_STR_PREFIX, ReplicaID, RequestProtocol
from ray.serve._private.constants import (
    RAY_SERVE_DIRECT_INGRESS_SHUTDOWN_BUFFER_S,
    SERVE_CONTROLLER_NAME,
    SERVE_NAMESPACE,
)
from ray.serve.deployment import Deployment

from base.waiting import WaitTimeout, wait_until

# Serve raises a direct-ingress deployment's graceful_shutdown_timeout_s to at least its minimum
# draining period plus this buffer, then force-kills the replica at that deadline.
SERVE_SHUTDOWN_BUFFER_S = float(RAY_SERVE_DIRECT_INGRESS_SHUTDOWN_BUFFER_S)


def with_rollout_version(deployment: Deployment, version: str) -> Deployment:
    """`deployment` under a fixed version: Serve restarts its replicas only when `version` (or their
    actor options) changes, and treats a new `num_replicas` alone as a scale, not a rollout."""
    return deployment.options(version=version, _internal=True)


def ray_resolves_node_ip_to_loopback() -> bool:
    """Whether this process's Ray keeps a node on 127.0.0.1. Ray reads
    `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER` once, at import: set to 0 any later and Ray silently
    swaps 127.0.0.1 for the machine's address and listens on every interface."""
    return not ray_constants.ENABLE_RAY_CLUSTER


# Serve writes this logger's records to the replica's own log file (`sluice deploy` shows its last lines); a module's
# own logger goes to the worker's stderr file instead.
REPLICA_LOGGER = "ray.serve"


class ControllerSettings(BaseModel):
    """What a running Serve controller was started with, as far as sluice depends on it."""

    model_config = ConfigDict(frozen=True)

    direct_ingress: bool
    # The controller's values of `base.runtime.SERVE_CONTROLLER_ENV_KEYS` (None: unset).
    env: dict[str, str | None]
    # Where Serve's HTTP (its proxies and every replica's own port) binds.
    http_host: str
    applications: list[str]


def _controller_view(controller: object, keys: list[str]) -> dict:
    import os

    return {
        "direct_ingress": controller._direct_ingress_enabled,  # type: ignore[attr-defined]
        "env": {key: os.environ.get(key) for key in keys},
        "http_host": controller.get_http_config().host,  # type: ignore[attr-defined]
        "applications": sorted(controller.application_state_manager.list_app_statuses()),  # type: ignore[attr-defined]
    }


def serve_controller_settings(keys: list[str], timeout_s: float) -> ControllerSettings | None:
    """The running Serve controller's settings, read inside its process (None: Serve is not started)."""
    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return None
    view = ray.get(controller.__ray_call__.remote(_controller_view, keys), timeout=timeout_s)
    return ControllerSettings.model_validate(view)


class ReplicaEndpoint(BaseModel):
    """Where one live replica serves HTTP, keyed by its Serve replica id."""

    model_config = ConfigDict(frozen=True)

    replica_id: str
    deployment: str
    host: str
    port: int
    # A router replica's route agent (services.router.route_listener): HAProxy's route calls go there over SPOE, its
    # health checks still to `port`.
    route_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def haproxy_port(self) -> int:
        """The port HAProxy's server points at: the route agent's, else Serve's."""
        return self.route_port or self.port


async def list_replica_endpoints(app_name: str) -> list[ReplicaEndpoint]:
    """Endpoints of the running replicas of `app_name`'s ingress deployment, sorted by id."""
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    try:
        groups = await controller.get_target_groups.remote(app_name, True)
    except ray.exceptions.RayTaskError as error:
        # The controller raises KeyError for an app that does not exist (or is being deleted).
        if isinstance(error.cause, KeyError):
            return []
        raise
    endpoints = []
    for group in groups:
        if group.protocol != RequestProtocol.HTTP or group.app_name != app_name:
            continue
        for target in group.targets:
            # With no running replica the controller lists Serve's proxies instead: skip those.
            if not target.name.startswith(REPLICA_ID_FULL_ID_STR_PREFIX):
                continue
            replica = ReplicaID.from_full_id_str(target.name)
            endpoints.append(
                ReplicaEndpoint(
                    replica_id=replica.unique_id,
                    deployment=replica.deployment_id.name,
                    host=target.ip,
                    port=target.port,
                )
            )
    return sorted(endpoints, key=lambda e: e.replica_id)


def wait_for_endpoints(app_name: str, count: int, timeout_s: float = 180.0) -> list:
    """Block until `app_name` has exactly `count` live replica endpoints; return them (`base.waiting.WaitTimeout`,
    a TimeoutError, past `timeout_s`)."""
    seen = [0]

    def exactly_count() -> list[ReplicaEndpoint] | None:
        endpoints = asyncio.run(list_replica_endpoints(app_name))
        seen[0] = len(endpoints)
        return endpoints if len(endpoints) == count else None

    try:
        return wait_until(timeout_s, exactly_count, what=f"{app_name} to have {count} live endpoints", poll_s=0.5)
    except WaitTimeout as error:
        raise WaitTimeout(f"{error} (it had {seen[0]})") from None


def replica_log_tail(app_name: str, deployment: str, lines: int) -> tuple[str, list[str]]:
    """The newest log file of a replica of `app_name`'s `deployment` on this machine's Ray session, and its last
    `lines` lines (no file: an empty list; a replica on another node logs there)."""
    from pathlib import Path

    node = ray._private.worker._global_node
    if node is None:
        return "", []
    folder = Path(node.get_session_dir_path()) / "logs" / "serve"
    files = sorted(folder.glob(f"replica_{app_name}_{deployment}_*.log"), key=lambda path: path.stat().st_mtime)
    if not files:
        return str(folder), []
    return str(files[-1]), files[-1].read_text(errors="replace").splitlines()[-lines:]


def send_ray_token_if_present() -> None:
    """Ray 2.60's `ray start` turns token authentication on when a token exists (`~/.ray/auth_token`,
    `RAY_AUTH_TOKEN`), but a driver connecting to that cluster sends it only when RAY_AUTH_MODE says so: do what
    `ray start` did (an explicit RAY_AUTH_MODE wins; a cluster without authentication ignores the token)."""
    from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def token_auth_enabled() -> bool:
    """Whether this process's Ray authenticates with its token; on a worker, the cluster's own mode."""
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    return is_token_auth_enabled()
