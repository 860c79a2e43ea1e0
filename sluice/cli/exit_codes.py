"""The exit codes of `sluice` commands: 0 done (a check passed), 1 a check or a gate failed, 2 a usage error
(argparse's own code, and sluice's for a bad value argparse cannot see), 3 the cluster or the target cannot be
reached (preflight), 4 a check incomplete (items skipped)."""

from __future__ import annotations

from sluice.deploy.check import CHECK_EXIT_FAIL, CHECK_EXIT_INCOMPLETE, CHECK_EXIT_PASS
from sluice.deploy.preflight import PREFLIGHT_EXIT_CODE

EXIT_OK = CHECK_EXIT_PASS
EXIT_FAILED = CHECK_EXIT_FAIL
EXIT_USAGE = 2
EXIT_UNREACHABLE = PREFLIGHT_EXIT_CODE
EXIT_INCOMPLETE = CHECK_EXIT_INCOMPLETE
