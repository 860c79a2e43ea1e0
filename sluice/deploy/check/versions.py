"""`sluice check`'s `versions` item: the Ray and vLLM of this CLI and of every LLM replica, the same everywhere and
equal to the versions the user expects (`--expect-ray`, `--expect-vllm`) where given."""

from __future__ import annotations

import httpx

from base.contracts import VERSIONS_PATH
from base.route_wire import ComponentVersions
from services.internal_credential import internal_headers
from sluice.deploy.check.items import Result

THIS_CLI = "this CLI"


def replica_versions(client: httpx.Client, replica_apps: dict[str, str]) -> dict[str, dict[str, str]]:
    """Each LLM replica's versions, asked on its own port (`replica_apps`: who -> its app's URL)."""
    found = {}
    for who, app in replica_apps.items():
        answer = client.get(f"{app}{VERSIONS_PATH}", headers=internal_headers())
        answer.raise_for_status()
        found[who] = ComponentVersions.model_validate(answer.json()).model_dump()
    return found


def versions(client: httpx.Client, base: str, replica_apps: dict[str, str] | None, expected: dict[str, str]) -> Result:
    """`replica_apps`: each LLM replica's app URL by `<model> replica <id>`; None (`--target`): only vLLM's version as
    the frontend's replicas report it (`GET /version`)."""
    cli = ComponentVersions.installed().model_dump()
    if replica_apps is None:
        replicas = {"a replica behind the frontend": {"vllm": client.get(f"{base}/version").json().get("version")}}
    else:
        replicas = replica_versions(client, replica_apps)
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
    where = (
        "the replicas behind the frontend (vllm)" if replica_apps is None else f"{len(replicas)} replicas (ray, vllm)"
    )
    pinned = f", as expected ({', '.join(sorted(expected))})" if expected else ""
    return True, f"ray {cli['ray']}, vllm {cli['vllm']} on {THIS_CLI}; the same on {where}{pinned}"
