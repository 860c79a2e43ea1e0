"""Shared fixtures: the tiny model is built once per checkout into the cache folder."""

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
