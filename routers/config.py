"""Kept only for `sluice/cli/main.py`, which imports `SETTINGS` from here; the policies' settings now live in
`routers.registry` (`SETTINGS`, `policy_names()`). Delete this module once the CLI imports the registry."""

from __future__ import annotations

from routers.registry import SETTINGS

__all__ = ["SETTINGS"]
