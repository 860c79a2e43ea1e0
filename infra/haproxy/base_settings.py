"""What every HAProxy sluice runs has, a stack's (`infra.haproxy.config.HAProxySettings`) or a platform's
(`infra.haproxy.platform_settings.PlatformHAProxySettings`): its workdir and the files in it, where it listens, its
timeouts, limits and request buffer."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from base.contracts import (
    DEFAULT_BIND_HOST,
    HAPROXY_ERROR_REASONS,
    HAPROXY_PORT_DEFAULT,
    HAPROXY_PROMETHEUS_PORT_DEFAULT,
    SERVE_REASON_HEADER,
)
from infra.haproxy.formatting import haproxy_time, openai_error_body
from infra.haproxy.protection import FrontendProtection

# Room in the request buffer beyond a maximal request: HAProxy's own headers and HTX's bookkeeping.
HEADER_HEADROOM_BYTES = 32768


class HAProxyBaseSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    workdir: Path
    bind_host: str = DEFAULT_BIND_HOST
    port: int = Field(HAPROXY_PORT_DEFAULT, ge=1, le=65535)
    prometheus_port: int = Field(HAPROXY_PROMETHEUS_PORT_DEFAULT, ge=1, le=65535)
    protection: FrontendProtection = FrontendProtection()
    timeout_client_s: float = Field(3600.0, gt=0)
    timeout_server_s: float = Field(3600.0, gt=0)
    timeout_connect_s: float = Field(5.0, gt=0)
    timeout_http_keep_alive_s: float = Field(90.0, gt=0)
    hard_stop_after_s: float = Field(120.0, gt=0)
    maxconn: int = Field(4096, ge=1)
    tune_maxrewrite: int = Field(8192, ge=1024)

    @field_validator("workdir")
    @classmethod
    def _absolute_workdir(cls, value: Path) -> Path:
        return value.resolve()

    @property
    def config_path(self) -> Path:
        return self.workdir / "haproxy.cfg"

    @property
    def socket_path(self) -> Path:
        """The runtime API's socket."""
        return self.workdir / "haproxy.sock"

    @property
    def log_path(self) -> Path:
        return self.workdir / "haproxy.log"

    @property
    def tune_bufsize(self) -> int:
        """Request buffer size: a whole request up to the protection's maxima (a body is whole before routing, and a
        model is read from it), plus HAProxy's rewrite reserve and its own headers' room."""
        return self.protection.request_bytes() + self.tune_maxrewrite + HEADER_HEADROOM_BYTES


def defaults_lines(settings: HAProxyBaseSettings) -> list[str]:
    """The `defaults` section every sluice HAProxy shares: HTTP mode, SSE without delay, its timeouts, and HAProxy's
    own errors in the contract's shape."""
    lines = [
        "defaults",
        "    mode http",
        "    # A soft stop (a frontend's hand-over) answers an idle keep-alive connection's next request with",
        "    # `Connection: close`, instead of closing it while the client may be sending one.",
        "    option idle-close-on-response",
        # SSE: send each event as soon as it arrives (without it the first event came ~205 ms late).
        "    option http-no-delay",
        f"    timeout connect {haproxy_time(settings.timeout_connect_s)}",
        f"    timeout client {haproxy_time(settings.timeout_client_s)}",
        f"    timeout server {haproxy_time(settings.timeout_server_s)}",
        f"    timeout http-keep-alive {haproxy_time(settings.timeout_http_keep_alive_s)}",
        f"    timeout http-request {haproxy_time(settings.protection.request_timeout_s)}",
        "    # HAProxy's own errors in the contract's shape: a reason header and an OpenAI-style JSON body.",
    ]
    for status, reason in HAPROXY_ERROR_REASONS.items():
        body = openai_error_body(f"sluice: {reason}", status)
        lines.append(
            f"    http-error status {status} content-type application/json"
            f" hdr {SERVE_REASON_HEADER} {reason} string '{body}'"
        )
    return lines
