"""The `sluice` command line: each command group registers its own commands (`register`)."""

from __future__ import annotations

import argparse
import sys

from base.runtime import apply_process_env
from sluice.cli import bench, cluster, keys, load, local, stack

# In `sluice --help`'s order.
COMMAND_GROUPS = (local, cluster, stack, keys, load, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for group in COMMAND_GROUPS:
        group.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    apply_process_env()
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
