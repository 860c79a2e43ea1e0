"""prometheus.yml for a sluice stack: its frontends' metrics ports as static targets, its routers and LLM replicas
through the frontends' HTTP service discovery (`infra.observability.targets`).

Jobs `sluice-haproxy`, `sluice-frontend`, `sluice-routers`, `sluice-replicas`; every target found carries
`sluice_role`, `sluice_app` and `sluice_replica` labels, which the dashboard groups by. Details: infra/README.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import yaml

from infra.haproxy.config import PROMETHEUS_PATH, SLUICE_METRICS_PATH, HAProxySettings
from infra.haproxy.formatting import haproxy_time
from infra.observability.targets import ROLE_REPLICA, ROLE_ROUTER, TARGETS_PATH, TARGETS_ROLE_PARAM

JOB_HAPROXY = "sluice-haproxy"
JOB_FRONTEND = "sluice-frontend"
JOB_ROUTERS = "sluice-routers"
JOB_REPLICAS = "sluice-replicas"
SCRAPE_INTERVAL_S_DEFAULT = 15.0
# Prometheus's own default scrape timeout; a timeout may not exceed the interval.
SCRAPE_TIMEOUT_S_MAX = 10.0


def metrics_address(settings: HAProxySettings) -> str:
    """Where a frontend's metrics port listens (`host:port`)."""
    return f"{settings.bind_host}:{settings.prometheus_port}"


def targets_url(frontend: str, role: str) -> str:
    """The service discovery URL of one role's targets on a frontend's metrics port."""
    return f"http://{frontend}{TARGETS_PATH}?{TARGETS_ROLE_PARAM}={role}"


def prometheus_config(frontends: Sequence[str], scrape_interval_s: float = SCRAPE_INTERVAL_S_DEFAULT) -> dict:
    """The configuration as data: `frontends` are the stack's frontends' metrics addresses (`host:port`). The
    discovery is refreshed as often as targets are scraped, so a replaced replica is scraped at its new port from
    the next refresh on."""
    if not frontends:
        raise ValueError("a stack has at least one frontend to scrape")
    if scrape_interval_s <= 0:
        raise ValueError(f"scrape_interval_s must be positive, not {scrape_interval_s}")
    # Prometheus durations read like HAProxy's times ("15s", "1500ms").
    interval = haproxy_time(scrape_interval_s)

    def static() -> list[dict]:  # a fresh list per job: the YAML then holds no anchors
        return [{"targets": list(frontends)}]

    def discovered(job: str, role: str) -> dict:
        sources = [{"url": targets_url(frontend, role), "refresh_interval": interval} for frontend in frontends]
        return {"job_name": job, "http_sd_configs": sources}

    return {
        "global": {
            "scrape_interval": interval,
            "scrape_timeout": haproxy_time(min(scrape_interval_s, SCRAPE_TIMEOUT_S_MAX)),
            "evaluation_interval": interval,
        },
        "scrape_configs": [
            {"job_name": JOB_HAPROXY, "metrics_path": PROMETHEUS_PATH, "static_configs": static()},
            {"job_name": JOB_FRONTEND, "metrics_path": SLUICE_METRICS_PATH, "static_configs": static()},
            discovered(JOB_ROUTERS, ROLE_ROUTER),
            discovered(JOB_REPLICAS, ROLE_REPLICA),
        ],
    }


def render_prometheus_config(frontends: Sequence[str], scrape_interval_s: float = SCRAPE_INTERVAL_S_DEFAULT) -> str:
    """prometheus.yml text (see `prometheus_config`)."""
    header = "# Rendered by infra/prometheus_config.py: do not edit by hand.\n"
    return header + yaml.safe_dump(prometheus_config(frontends, scrape_interval_s), sort_keys=False)
