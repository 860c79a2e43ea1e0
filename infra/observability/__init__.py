"""What a sluice stack ships for its observability: the Prometheus discovery of its targets (`targets`, served by
the frontend's Lua services in `METRICS_LUA_TEMPLATE_PATH`), the scrape config around it (`infra.prometheus_config`)
and a Grafana dashboard over what they export (`DASHBOARD_PATH`, checked by `dashboard`); a platform's dashboard
(`PLATFORM_DASHBOARD_PATH`) reads its frontend's counters and HAProxy's own backend series."""

from __future__ import annotations

from pathlib import Path

DASHBOARD_PATH = Path(__file__).with_name("sluice-dashboard.json")
# A platform's own dashboard (services/platform/README.md): its tenants and attached models.
PLATFORM_DASHBOARD_PATH = Path(__file__).with_name("sluice-platform-dashboard.json")
# The frontend's metrics services in Lua, rendered after the route action by `infra.haproxy.lua`.
METRICS_LUA_TEMPLATE_PATH = Path(__file__).with_name("frontend_metrics.lua.tmpl")
