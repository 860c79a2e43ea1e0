"""One stand-in data plane per test module, reset to a router that chooses r1/r2 before each test."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.integration.standin_plane.plane import Env, running_env
from tests.integration.standin_plane.standins import (
    rearm_stall,
)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with running_env(tmp_path_factory.mktemp("haproxy")) as started:
        yield started


@pytest.fixture(autouse=True)
def reset_behavior(env: Env) -> Iterator[None]:
    env.behavior.mode = "choose"
    env.behavior.replica_ids = ["r1", "r2"]
    env.behavior.ranked = None
    env.behavior.capacity_token = None
    yield
    rearm_stall(env.loop, env.behavior)


@pytest.fixture
def client(env: Env) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=env.plane.url, timeout=10) as c:
        yield c
