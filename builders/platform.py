"""A platform file becomes a plan: one Serve app, the platform's frontend (`services.platform.app`), named like a
stack's frontend app (`<name>-platform-frontend`) so the port checks and `sluice down` treat it like one; a plan
across nodes places it on the head node."""

from __future__ import annotations

from base.contracts import PRIORITY_CLASSES
from base.runtime import LOOPBACK
from builders.plan import frontend_app_name
from builders.plan_types import ServeApp, StackPlan, import_path
from infra.haproxy.platform_settings import TenantRoute
from services.platform.app import PlatformArgs, PlatformTenant, build_platform_application
from topologies.platform import PlatformSpec, Tenant


def _tenant(tenant: Tenant) -> PlatformTenant:
    limits = tenant.limits
    route = TenantRoute(
        name=tenant.team,
        priority_class=PRIORITY_CLASSES.index(tenant.priority),
        weight=tenant.weight,
        max_concurrent_requests=limits.max_concurrent_requests,
        requests_per_minute=limits.requests_per_minute,
        tokens_per_minute=limits.tokens_per_minute,
    )
    return PlatformTenant(team=tenant.team, api_keys=tenant.api_keys, models=tenant.models, route=route)


def build_platform_plan(spec: PlatformSpec, spans_nodes: bool = False) -> StackPlan:
    frontend = spec.frontend
    tenants = [_tenant(tenant) for tenant in spec.tenants]
    haproxy = {
        "platform": spec.name,
        "tenants": [tenant.route.model_dump(mode="json") for tenant in tenants],
        "port": frontend.port,
        "prometheus_port": frontend.metrics_port,
        "protection": frontend.protection.model_dump(mode="json"),
        "model_slots": spec.admission.model_slots,
        "queue_timeout_s": spec.admission.queue_timeout_s,
    }
    args = PlatformArgs(
        platform=spec.name,
        stack=spec.stack,
        haproxy=haproxy,
        tenants=tenants,
        node_role="head" if spans_nodes else None,
    )
    app = ServeApp(
        name=frontend_app_name(spec.stack),
        route_prefix=None,
        import_path=import_path(build_platform_application),
        args=args.model_dump(mode="json"),
    )
    return StackPlan(stack=spec.stack, apps=[app], models=[], url=f"http://{LOOPBACK}:{frontend.port}")
