"""Shared fixtures and the suite's tiers: the tiny model is built once per checkout into the cache folder; a test that
needs Ray carries the marker `ray` (`make test-fast` runs the others); `make test-ray` runs the modules with a Ray or
an engine of their own, then the session cluster's."""

from __future__ import annotations

from base.runtime import apply_process_env

# Before anything imports ray: Ray reads its loopback switch once, at import.
apply_process_env()

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from base.runtime import default_model_dir  # noqa: E402
from base.tiny_model import ensure_built  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return ensure_built(default_model_dir())


# CI sets this: a skipped test is a check that did not run, and the run fails instead of passing without it.
FORBID_SKIPS_ENV = "SLUICE_FORBID_SKIPS"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    import os

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if os.environ.get(FORBID_SKIPS_ENV) == "1" and skipped:
        names = ", ".join(report.nodeid for report in skipped)
        print(f"\n{FORBID_SKIPS_ENV}=1 and {len(skipped)} test(s) skipped: {names}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# The session's Ray cluster (tests/integration/conftest.py); the markers of a module that starts a Ray of its own and
# of one that starts a vLLM engine in the test process: `make test-ray` runs them before the session's cluster starts.
SESSION_CLUSTER_FIXTURE = "ray_cluster"
OWN_PROCESSES_MARKERS = ("own_ray", "engine")


def _ray_rank(item: pytest.Item) -> int:
    """0: no Ray, no engine; 1: a Ray or an engine of its own; 2: the session's cluster, which starts at its first
    test and stays up."""
    if SESSION_CLUSTER_FIXTURE in getattr(item, "fixturenames", ()):
        return 2
    return 1 if any(item.get_closest_marker(marker) for marker in OWN_PROCESSES_MARKERS) else 0


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that needs Ray `ray` (before `-m` selects), then run whole modules in Ray rank order. Measured:
    the own-Ray modules run beside the session cluster's saturate both cores, each side runs about twice as slow, and
    the routing suite's hit-rate margins failed once under it; so the two run one after the other."""
    module_rank: dict[str, int] = {}
    for item in items:
        rank = _ray_rank(item)
        if rank == 2 or item.get_closest_marker("own_ray"):
            item.add_marker(pytest.mark.ray)
        module = item.nodeid.split("::")[0]
        module_rank[module] = max(rank, module_rank.get(module, 0))
    items.sort(key=lambda item: module_rank[item.nodeid.split("::")[0]])
