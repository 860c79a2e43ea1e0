"""The `sluice` command line: each command group registers its own commands (`register`).

Shell completion: `eval "$(sluice completion bash)"` (argcomplete; `sluice completion --help` for the other shells).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import argcomplete

from base.route_wire import ComponentVersions, installed_version
from base.runtime import apply_process_env
from sluice.cli import bench, cluster, completion, keys, load, local, stack
from sluice.cli.examples import epilog
from sluice.deploy.errors import Unreachable, UsageError
from sluice.deploy.exit_codes import EXIT_FAILED, EXIT_UNREACHABLE, EXIT_USAGE
from topologies.problems import SpecError

# In `sluice --help`'s order.
COMMAND_GROUPS = (local, cluster, stack, keys, load, bench, completion)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's default, and the examples block kept line by line."""


class SluiceParser(argparse.ArgumentParser):
    """Every command's parser: its help shows each option's default and the command's examples."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


def version_line() -> str:
    """sluice's version and the Ray and vLLM it runs with (installed here; `sluice check` compares the replicas')."""
    components = ComponentVersions.installed()
    return f"sluice {installed_version('sluice')} ray {components.ray} vllm {components.vllm}"


def build_parser() -> argparse.ArgumentParser:
    parser = SluiceParser(prog="sluice", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=version_line())
    commands = parser.add_subparsers(dest="command", required=True)
    for group in COMMAND_GROUPS:
        group.register(commands)
    _describe(parser)
    return parser


def _describe(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> None:
    """Each command's one-line help (what `sluice --help` lists) is also its own `--help`'s description; its examples
    (`sluice.cli.examples`) close its help."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for listed in action._choices_actions:
                command = action.choices[listed.dest]
                command.description = command.description or listed.help
                command.epilog = epilog(" ".join((*path, listed.dest)))
                _describe(command, (*path, listed.dest))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # A shell asking for completions (argcomplete's protocol) is answered here and the process exits.
    argcomplete.autocomplete(parser)
    apply_process_env()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SpecError as error:  # names the file and every problem
        print(error, file=sys.stderr)
        return EXIT_FAILED
    except (UsageError, Unreachable) as error:
        print(f"sluice {args.command}: {error}", file=sys.stderr)
        return EXIT_USAGE if isinstance(error, UsageError) else EXIT_UNREACHABLE


if __name__ == "__main__":
    sys.exit(main())
