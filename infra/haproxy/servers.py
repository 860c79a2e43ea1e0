"""The keywords of the servers the syncer adds at run time (`add server`): replicas, routers and legacy ingress
replicas. Dynamic servers do not inherit `default-server`, so every setting goes on each server
(infra/haproxy/README.md).
"""

from __future__ import annotations

from infra.haproxy.config import HAProxySettings
from infra.haproxy.formatting import haproxy_time

# How long an unneeded idle connection to a replica is kept (HAProxy's default is 5 s).
IDLE_PURGE_S = 1.0


def _check_options(settings: HAProxySettings) -> list[str]:
    return [
        "check",
        "inter",
        haproxy_time(settings.check_inter_s),
        "fastinter",
        haproxy_time(settings.check_fastinter_s),
        "downinter",
        haproxy_time(settings.check_downinter_s),
        "fall",
        str(settings.check_fall),
        "rise",
        str(settings.check_rise),
    ]


def replica_server_options(settings: HAProxySettings) -> list[str]:
    """`add server` keywords of a replica: weight 0 (reached only when pinned), health-checked, and DOWN at the
    first failed connection so the next request goes straight to a fallback. Idle keep-alive connections are
    purged within `IDLE_PURGE_S` of no longer being needed: HAProxy deletes a server only without connections,
    and a leaving replica's last streams hand theirs back to the idle pool after it went to maintenance."""
    return [
        "weight",
        "0",
        *_check_options(settings),
        "observe",
        "layer4",
        "error-limit",
        "1",
        "on-error",
        "mark-down",
        "pool-purge-delay",
        haproxy_time(IDLE_PURGE_S),
    ]


def router_server_options(settings: HAProxySettings) -> list[str]:
    return _check_options(settings)


def agent_server_options(settings: HAProxySettings) -> list[str]:
    """A router's route agent: health-checked on Serve's port, and DOWN at the first failed connection, so the next
    route call goes to another agent (or over HTTP) at once."""
    return [*_check_options(settings), "observe", "layer4", "error-limit", "1", "on-error", "mark-down"]


def legacy_server_options(settings: HAProxySettings) -> list[str]:
    """A legacy ingress replica: health-checked and load-balanced (it routes to the LLM replicas itself)."""
    return _check_options(settings)
