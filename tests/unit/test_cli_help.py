"""`sluice --version` and every command's `--help`: a description, and each option's default."""

from __future__ import annotations

import argparse

import pytest

from sluice.cli.main import build_parser, main


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
