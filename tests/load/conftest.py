"""The SSE test server with known timing (`tests/support/known_timing_server.py`), one per module, with the module's
`KNOWN_TIMING_FLAGS` (default: none, the server's default timing), and the file where it records when each stream's
events left."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.known_timing_server import start


@pytest.fixture(scope="module")
def truth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("truth") / "events.jsonl"


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, truth: Path) -> Iterator[str]:
    process, url = start(*getattr(request.module, "KNOWN_TIMING_FLAGS", ()), "--record", str(truth))
    yield url
    process.terminate()
    process.wait(timeout=10)
