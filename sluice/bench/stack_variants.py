"""A stack redeployed with another policy or replica count, one of its LLM replicas killed, its capacity ledger read,
its non-2xx answers counted: what the routing suite, the soak and the overload bench do to a running stack."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterable
from typing import Any


def deploy_variant(data: dict[str, Any], policy: str, replicas: int, **routing: Any) -> Any:
    """The spec's stack with `policy` (its kwargs from the spec when the spec names it) and `routing` overrides; every
    other routing field (body forwarding, KV events) as the spec has it, so a policy switch leaves the LLM replicas."""
    from builders.plan import build_plan
    from builders.specs import parse_spec
    from sluice.deploy.apply import apply_plan

    variant = json.loads(json.dumps(data))
    spec_routing = variant.get("routing", {})
    kwargs = spec_routing.get("policy_kwargs", {}) if spec_routing.get("policy") == policy else {}
    variant["routing"] = {**spec_routing, "policy": policy, "policy_kwargs": kwargs, **routing}
    for model in variant["models"]:
        model.pop("autoscaling", None)
        model["replicas"] = replicas
    spec = parse_spec(variant)
    plan = build_plan(spec)
    if not apply_plan(spec, plan):
        raise RuntimeError(f"the {policy} stack with {replicas} replicas did not come up")
    return plan


def kill_one_replica(plan: Any) -> str:
    """SIGKILL-like end of one LLM replica actor (Serve starts a new one)."""
    import ray

    from services.serve_internals import list_replica_endpoints

    model = plan.models[0]
    victim = asyncio.run(list_replica_endpoints(model.llm_app))[0]
    name = f"SERVE_REPLICA::{model.llm_app}#{victim.deployment}#{victim.replica_id}"
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    return victim.replica_id


def ledger_snapshot(plan: Any) -> dict[str, Any]:
    """The capacity ledger of the plan's first model (`CapacityLedger.snapshot`): tokens out, waiters, counts."""
    import ray

    from routers.ledger_actor import LEDGER_NAMESPACE, ledger_actor_name
    from services.serve_internals import list_replica_endpoints

    model = plan.models[0]
    deployment = asyncio.run(list_replica_endpoints(model.llm_app))[0].deployment
    ledger = ray.get_actor(ledger_actor_name(model.llm_app, deployment), namespace=LEDGER_NAMESPACE)
    return ray.get(ledger.snapshot.remote(), timeout=30)


def non_2xx(answers: Iterable[tuple[int, str | None]]) -> dict[str, int]:
    """Answers other than 2xx counted by `"<status> <reason>"` (`-` for none) from (status, reason) pairs; a status 0
    (no response at all) is not an answer."""
    answered = ((status, reason) for status, reason in answers if status and not 200 <= status < 300)
    return dict(Counter(f"{status} {reason or '-'}" for status, reason in answered))
