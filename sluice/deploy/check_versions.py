"""`sluice check`'s `versions` item: the Ray and vLLM of this CLI and of every LLM replica, the same everywhere and
equal to the versions the user expects (`--expect-ray`, `--expect-vllm`) where given."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import httpx

from base.contracts import VERSIONS_PATH
from base.route_wire import ComponentVersions
from sluice.deploy.check_items import Result

if TYPE_CHECKING:
    from builders.plan import StackPlan

THIS_CLI = "this CLI"


def replica_versions(client: httpx.Client, plan: StackPlan) -> dict[str, dict[str, str]]:
    """Each LLM replica's versions, asked on its own port, by `<model> replica <id>`."""
    from services.serve_internals import list_replica_endpoints

    found = {}
    for model in plan.models:
        for endpoint in asyncio.run(list_replica_endpoints(model.llm_app)):
            answer = client.get(f"{endpoint.url}/{model.llm_app}{VERSIONS_PATH}")
            answer.raise_for_status()
            found[f"{model.name} replica {endpoint.replica_id}"] = ComponentVersions.model_validate(answer.json())
    return {who: versions.model_dump() for who, versions in found.items()}


def versions(client: httpx.Client, base: str, plan: StackPlan | None, expected: dict[str, str]) -> Result:
    """Without a plan (`--target`) only vLLM's version as the frontend's replicas report it (`GET /version`)."""
    cli = ComponentVersions.installed().model_dump()
    if plan is None:
        replicas = {"a replica behind the frontend": {"vllm": client.get(f"{base}/version").json().get("version")}}
    else:
        replicas = replica_versions(client, plan)
        if not replicas:
            return False, "no LLM replica is running"
    wanted = {**cli, **expected}
    problems = [
        f"{THIS_CLI} runs {name} {cli[name]}, expected {want}" for name, want in expected.items() if cli[name] != want
    ]
    problems += [
        f"{who} runs {name} {found}, {'expected' if name in expected else THIS_CLI} {wanted[name]}"
        for who, runs in replicas.items()
        for name, found in runs.items()
        if found != wanted[name]
    ]
    if problems:
        return False, "; ".join(problems)
    where = f"{len(replicas)} replicas (ray, vllm)" if plan is not None else "the replicas behind the frontend (vllm)"
    pinned = f", as expected ({', '.join(sorted(expected))})" if expected else ""
    return True, f"ray {cli['ray']}, vllm {cli['vllm']} on {THIS_CLI}; the same on {where}{pinned}"
