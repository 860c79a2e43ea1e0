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
