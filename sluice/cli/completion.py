"""`sluice completion SHELL`: the shell code that completes sluice's commands and options (argcomplete's)."""

from __future__ import annotations

import argparse
from typing import Any

SHELLS = ("bash", "zsh", "fish", "tcsh", "powershell")


def _completion(args: argparse.Namespace) -> int:
    import argcomplete

    print(argcomplete.shellcode(["sluice"], shell=args.shell))
    return 0


def register(commands: Any) -> None:
    completion = commands.add_parser("completion", help="shell completion code for sluice (eval it, or source it)")
    completion.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    completion.set_defaults(func=_completion)
