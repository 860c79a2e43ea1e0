"""The exit codes of `sluice` commands, one table for all: 0 done (a check passed), 1 a check or a gate failed (a
canary that rolled back by itself included), 2 a usage error (argparse's own code, and sluice's for a bad value
argparse cannot see), 3 the cluster or the target cannot be reached (preflight), 4 a check incomplete (items
skipped)."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_INCOMPLETE = 4
