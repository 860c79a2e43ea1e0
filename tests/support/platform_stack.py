"""A platform deployed from a platform file onto the session's Ray cluster under its own name and ports, its
tenants' keys generated into the test's folder, for one test module; removed after it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from builders.platform import build_platform_plan
from infra.api_keys import key_hash_line, new_api_key
from sluice.deploy.apply import delete_plan
from sluice.deploy.platforms import apply_platform
from tests.support.frontend_contract import register_frontend
from tests.support.ports import free_port
from topologies.platform import PlatformSpec, load_platform

PLATFORM_START_TIMEOUT_S = 120.0


@dataclass
class Platform:
    spec: PlatformSpec
    url: str
    # Each tenant's one key, by team.
    keys: dict[str, str]

    def headers(self, team: str, **extra: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.keys[team]}", **extra}


@contextmanager
def platform_stack(name: str, folder: Path, tenants: list[dict[str, Any]], **admission: Any) -> Iterator[Platform]:
    """`tenants`: each tenant's section without its keys (a key per tenant is generated)."""
    keys = {tenant["team"]: new_api_key() for tenant in tenants}
    for team, key in keys.items():
        (folder / f"{team}.keys").write_text(key_hash_line(key) + "\n")
    port = free_port()
    data = {
        "kind": "platform",
        "name": name,
        "frontend": {"port": port, "metrics_port": free_port()},
        "tenants": [{**tenant, "api_keys": {"file": f"{tenant['team']}.keys"}} for tenant in tenants],
        "admission": admission,
    }
    path = folder / "platform.yaml"
    path.write_text(yaml.safe_dump(data))
    spec = load_platform(path)
    plan = build_platform_plan(spec)
    register_frontend(port, platform=True)
    try:
        assert apply_platform(spec, plan, PLATFORM_START_TIMEOUT_S, source=str(path)), f"{name} did not start"
        yield Platform(spec, f"http://127.0.0.1:{port}", keys)
    finally:
        delete_plan(plan, wait=False)
