"""The SSE test server with known timing (`tests/support/known_timing_server.py`, its default timing), one per
module, and the file where it records when each stream's events left."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.known_timing_server import start


@pytest.fixture(scope="module")
def truth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("truth") / "events.jsonl"


@pytest.fixture(scope="module")
def server(truth: Path) -> Iterator[str]:
    process, url = start("--record", str(truth))
    yield url
    process.terminate()
    process.wait(timeout=10)
