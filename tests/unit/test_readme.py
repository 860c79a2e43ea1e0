"""The README's table of the statuses the frontend returns itself stays true to the contracts module."""

from __future__ import annotations

import re
from pathlib import Path

from base import contracts

README = Path(__file__).resolve().parents[2] / "README.md"


def _status_rows() -> dict[str, str]:
    text = README.read_text()
    section = text[text.index("### Every status the frontend returns itself") :]
    section = section[: section.index("\n## ")]
    return {m[1]: m[2] for m in re.finditer(r"^\| ([^|]+?) \| ([^|]+?) \|", section, re.M)}


def test_every_frontend_status_is_listed_with_its_reason() -> None:
    rows = _status_rows()
    pairs = [
        *contracts.HAPROXY_ERROR_REASONS.items(),
        *contracts.PROTECTION_REASONS.items(),
        *((503, reason) for reason in contracts.FAIL_CLOSED_REASONS),
    ]
    for status, reason in pairs:
        assert str(status) in rows, f"README lists no {status}"
        assert f"`{reason}`" in rows[str(status)], f"README: {status} without `{reason}`"
    assert f"`{contracts.REASON_REPLICA_ERROR}`" in rows["a replica's 5xx"]
