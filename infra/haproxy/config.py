"""HAProxySettings, everything the rendered HAProxy config and Lua action depend on, and the names inside them.

Nothing of the wire contract is here (that is `base.contracts`): these are HAProxy-internal names (frontends,
backends, tables, transaction variables, Lua patterns) shared by the renderers (`infra.haproxy.haproxy_cfg`,
`infra.haproxy.lua`) and by what drives HAProxy at run time. Shape of the config and why: infra/haproxy/README.md.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, SecretStr, model_validator

from base.contracts import (
    DIRECT_WEIGHT_MAX,
    INTERNAL_CREDENTIAL_HEADER,
    ROUTE_TIMEOUT_S_DEFAULT,
)
from infra.haproxy.apps import BODY_BUFFER_BYTES_DEFAULT, AppRoute
from infra.haproxy.base_settings import HAProxyBaseSettings
from infra.haproxy.canary import LOG_SOCKET, WEIGHTS_MAP
from infra.haproxy.tls import FrontendTLS

# Names inside the rendered config (HAProxy-internal, not part of the wire contract).
FRONTEND = "sluice_http"
RETRY_FRONTEND = "sluice_retry"
PROMETHEUS_FRONTEND = "sluice_prometheus"
REPLICA_BACKEND = "sluice_replicas"
ROUTER_BACKEND = "sluice_routers"
FALLBACK_TABLE = "sluice_fallbacks"
UNROUTED_TABLE = "sluice_unrouted"
LUA_ACTION = "sluice_route"
LUA_RETRY_ACTION = "sluice_retry"
LUA_METRICS_SERVICE = "sluice_metrics"
VAR_SERVER = "txn.sluice_server"
VAR_REASON = "txn.sluice_reason"
VAR_REQUEST_ID = "txn.sluice_request_id"
VAR_RANK = "txn.sluice_rank"
VAR_FALLBACK = "txn.sluice_fallback"
# The pinned replica's app: its replica backend, and the route prefix its replicas serve under.
VAR_BACKEND = "txn.sluice_backend"
VAR_PREFIX = "txn.sluice_prefix"
# Set on a staging frontend's request that asked for the short server timeout (`STAGING_TIMEOUT_HEADER`).
VAR_STAGING_TIMEOUT = "txn.sluice_staging_timeout"
# Servers of sluice's own (the retry loop) start with "_"; replica and router ids may not.
RETRY_SERVERS = ("_retry1", "_retry2")
INTERNAL_SERVER_PREFIX = "_"
PROMETHEUS_PATH = "/metrics"
SLUICE_METRICS_PATH = "/sluice/metrics"
# A server name is the replica (or router) id: what HAProxy accepts in a name, starting with a letter or digit.
SERVER_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,255}$")
# Defaults shared with `sluice.bench.stack_harness.DirectStreamSpec`.
CHECK_INTER_S_DEFAULT = 5.0
# Lua patterns for values taken from the router's reply (anything else is refused, so nothing reaches a header
# or a map lookup unchecked).
LUA_REPLICA_ID_PATTERN = "^[%w][%w%-_.:]*$"
LUA_TOKEN_PATTERN = "^[%w%-_.:~+/=]+$"
LUA_REASON_PATTERN = "^[a-z0-9_]+$"
# An http URL: host, port, then an optional route prefix.
LUA_URL_PATTERN = "^http://[%w%-.]+:%d+[/%w%-_.]*$"
# A `traceparent` the router answered: version 00, the trace id, its span's id, the flags (W3C trace context).
LUA_TRACEPARENT_PATTERN = "^00%-%x+%-%x+%-%x%x$"
MAX_ID_LENGTH = 256
# Unix socket paths must fit `sun_path` (108 bytes on Linux, including the NUL).
MAX_SOCKET_PATH_BYTES = 103


class HAProxySettings(HAProxyBaseSettings):
    """Everything a stack's rendered HAProxy config and Lua action depend on."""

    # One app per model; the first also takes GET/HEAD requests that name no model. With several apps, each names
    # its model and a request's model picks its app.
    apps: list[AppRoute] = Field(min_length=1)
    # How much of a body a multi-model frontend searches for the request's `model`.
    model_lookup_bytes: int = Field(BODY_BUFFER_BYTES_DEFAULT, ge=1024, le=64 * 1024 * 1024)
    route_timeout_s: float = Field(ROUTE_TIMEOUT_S_DEFAULT, gt=0, le=60)
    # Timeout of one TCP connect attempt to a router. HAProxy retries a failed connect 3 times, so a router that
    # refuses or drops connections costs about 3x this before the next router is tried (measured: 0.05 s -> +0.15 s),
    # and only until this HAProxy thread has marked it suspect or the health check has marked it down.
    route_connect_timeout_s: float = Field(0.05, gt=0, le=10)
    # Health checks (docs/design.md §3: Ray's defaults).
    check_inter_s: float = Field(CHECK_INTER_S_DEFAULT, gt=0)
    check_fastinter_s: float = Field(0.25, gt=0)
    check_downinter_s: float = Field(0.25, gt=0)
    check_fall: int = Field(2, ge=1)
    check_rise: int = Field(2, ge=1)
    # A staging stack's: the server timeout of a request that asks for it (`STAGING_TIMEOUT_HEADER`); None: the
    # header does nothing (not a staging stack).
    staging_server_timeout_s: float | None = Field(None, gt=0)
    # None: HAProxy's default (one thread per CPU it may run on).
    nbthread: int | None = Field(None, ge=1)
    # TLS on `port` (None: plain HTTP there).
    tls: FrontendTLS | None = None
    # Share of sessions on the direct path at start (the rest go to each app's legacy backend); changed at run time.
    direct_weight: int = Field(DIRECT_WEIGHT_MAX, ge=0, le=DIRECT_WEIGHT_MAX)
    # A stack attached to a platform: the platform's tenant and usage headers pass (with the internal credential).
    attached: bool = False
    # The routers trace their decisions (`base.tracing`): each route call carries the request's `traceparent`, and
    # the one the router answers (its decision's span) replaces it on the forwarded request. False: neither.
    tracing: bool = False
    # The cluster's internal credential, set on every request forwarded past the frontend and on every route call
    # (services/internal_credential.py); None: none is set (HAProxy in front of stand-ins). Private: never printed.
    internal_credential: SecretStr | None = None

    def internal_header(self) -> tuple[str, str] | None:
        """(name, value) of the internal credential header HAProxy sends past the frontend, if any."""
        if self.internal_credential is None:
            return None
        return INTERNAL_CREDENTIAL_HEADER, self.internal_credential.get_secret_value()

    @model_validator(mode="after")
    def _socket_path_fits(self) -> HAProxySettings:
        for path in (self.socket_path, self.retry_socket_path, self.log_socket_path):
            if len(str(path).encode()) > MAX_SOCKET_PATH_BYTES:
                raise ValueError(f"unix socket path {path} is longer than {MAX_SOCKET_PATH_BYTES} bytes")
        if self.prometheus_port == self.port:
            raise ValueError("prometheus_port must differ from port")
        if self.tls is not None and self.tls.plain_port in (self.port, self.prometheus_port):
            raise ValueError("tls.plain_port must differ from port and prometheus_port")
        for app in self.apps:
            if app.forward_body and app.body_buffer_bytes > self.protection.max_body_bytes:
                raise ValueError(
                    f"{app.name}: body_buffer_bytes (forwarded to the router) may not exceed protection.max_body_bytes"
                )
        names = [app.name for app in self.apps]
        if len(set(names)) != len(names):
            raise ValueError(f"app names must be distinct: {names}")
        if self.multi_model:
            models = [app.model for app in self.apps]
            if None in models or len(set(models)) != len(models):
                raise ValueError(f"with several apps each names a distinct model: {models}")
        return self

    @property
    def multi_model(self) -> bool:
        """Whether a request's model picks its app (more than one app)."""
        return len(self.apps) > 1

    @property
    def app(self) -> AppRoute:
        """The first app: the only one of a single-model frontend."""
        return self.apps[0]

    @property
    def lua_path(self) -> Path:
        return self.workdir / "sluice_route.lua"

    @property
    def spoe_path(self) -> Path:
        """The route agents' SPOE engines (`infra.haproxy.spoe`)."""
        return self.workdir / "sluice_route.spoe"

    @property
    def retry_socket_path(self) -> Path:
        """Where frontend `sluice_retry` listens for the requests whose pinned replica refused the connection."""
        return self.workdir / "retry.sock"

    @property
    def weights_map_path(self) -> Path:
        """Each app's direct weight (`infra.haproxy.canary`), read at start and changed at run time."""
        return self.workdir / WEIGHTS_MAP

    @property
    def log_socket_path(self) -> Path:
        """Where the frontend replica reads HAProxy's request log."""
        return self.workdir / LOG_SOCKET

    @property
    def frontend_id(self) -> str:
        """This frontend's name in route calls and membership publications."""
        return f"{self.bind_host}:{self.port}"

    @property
    def listener_sockets(self) -> tuple[Path, ...]:
        return self.socket_path, self.retry_socket_path

    @property
    def keys_acl_path(self) -> Path:
        """The accepted API key digests, as HAProxy's pattern file (written at start, replaced at run time)."""
        return self.workdir / "api_keys.acl"

    @property
    def tls_pem_path(self) -> Path:
        """The frontend's certificate and key as HAProxy loads them (written at start, replaced at run time)."""
        return self.workdir / "frontend.pem"


def replica_backend(index: int) -> str:
    """The replica backend of app `index` (the first app's keeps the plain name)."""
    return REPLICA_BACKEND if index == 0 else f"{REPLICA_BACKEND}_{index}"


def router_backend(index: int) -> str:
    return ROUTER_BACKEND if index == 0 else f"{ROUTER_BACKEND}_{index}"


def is_internal_server(name: str) -> bool:
    return name.startswith(INTERNAL_SERVER_PREFIX)
