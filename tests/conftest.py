"""Shared fixtures: the tiny model is built once per checkout into the cache folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.cli import ensure_model
from sluice.runtime import default_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return ensure_model(default_model_dir())
