"""`sluice --version` and every command's `--help`: a description, and each option's default."""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.cli.examples import EXAMPLES
from sluice.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path (`("load",)`, `("stack", "up")`, ...) under `parser`."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append((*prefix, name))
                found += _commands(sub, (*prefix, name))
    return found


def test_version_names_sluice_ray_and_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    out = capsys.readouterr().out.split()
    assert out[0::2] == ["sluice", "ray", "vllm"] and all(part[0].isdigit() for part in out[1::2])


@pytest.mark.parametrize("command", _commands(build_parser()), ids=" ".join)
def test_every_commands_help_describes_it_and_shows_defaults(
    command: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*command, "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    usage, _, rest = out.partition("\n\n")
    description = rest.split("\n\n")[0]
    assert usage.startswith(f"usage: sluice {' '.join(command)}"), out
    assert description.strip() and not description.startswith(("options:", "positional arguments:")), out


def test_an_options_default_is_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["load", "--help"])
    assert "seconds of load (default: 60.0)" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("command", _commands(build_parser()), ids=" ".join)
def test_every_command_shows_examples_that_parse(command: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    examples = EXAMPLES[" ".join(command)]
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    assert capsys.readouterr().out.rstrip().endswith("examples:\n" + "\n".join(f"  {line}" for line in examples))
    for line in examples:
        words = shlex.split(line.split(" > ")[0].split(" >> ")[0].split(" < ")[0].removeprefix('eval "$(').rstrip(')"'))
        assert words[0] == "sluice", line
        build_parser().parse_args(words[1:])  # a SystemExit here is an example that does not parse


def test_the_shell_completes_commands_and_options(tmp_path: Path) -> None:
    """argcomplete's protocol, as bash's completion function drives it: the candidates for a partial command line."""

    def complete(line: str) -> set[str]:
        out = tmp_path / "candidates"
        env = os.environ | {
            "_ARGCOMPLETE": "1",
            "COMP_LINE": line,
            "COMP_POINT": str(len(line)),
            "_ARGCOMPLETE_STDOUT_FILENAME": str(out),
        }
        done = subprocess.run([sys.executable, "-m", "sluice.cli.main"], env=env, cwd=ROOT, timeout=60, check=False)
        assert done.returncode == 0
        return set(out.read_text().split("\x0b"))

    assert complete("sluice sta") == {"status", "stack"}
    assert {"--master", "--master-bind-host", "--master-port"} <= complete("sluice load mixed --mas")
    script = subprocess.run(
        [sys.executable, "-m", "sluice.cli.main", "completion", "bash"], capture_output=True, text=True, check=True
    ).stdout
    assert "complete " in script and "sluice" in script


def test_every_argument_says_what_it_is() -> None:
    def undescribed(parser: argparse.ArgumentParser, path: str = "sluice") -> list[str]:
        found = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found += undescribed(sub, f"{path} {name}")
            elif not action.help:
                found.append(f"{path} {action.option_strings or action.dest}")
        return found

    assert undescribed(build_parser()) == []
