"""Every known bad input to a `sluice` command: a line that says what is wrong, the documented exit code, and never a
traceback (sluice/deploy/exit_codes.py). `sluice load`'s own values: tests/unit/test_load_cli_input.py."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.cli.main import main
from sluice.deploy.exit_codes import EXIT_FAILED, EXIT_UNREACHABLE, EXIT_USAGE

ROOT = Path(__file__).resolve().parents[2]
MISSING = "/nonexistent/stack.yaml"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def not_yaml(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("bad") / "stack.yaml"
    path.write_text("models: [\n")
    return str(path)


@pytest.mark.parametrize(
    ("arguments", "code", "message"),
    [
        (["validate", MISSING], EXIT_FAILED, "cannot read the file"),
        (["validate", "{not_yaml}"], EXIT_FAILED, "not valid YAML"),
        (["render", MISSING, "--kuberay"], EXIT_FAILED, "cannot read the file"),
        (["serve", MISSING], EXIT_FAILED, "cannot read the file"),
        (["serve", "{not_yaml}"], EXIT_FAILED, "not valid YAML"),
        (["stack", "status", MISSING], EXIT_FAILED, "cannot read the file"),
        (["stack", "down", "{not_yaml}"], EXIT_FAILED, "not valid YAML"),
        (["check", "--target", "127.0.0.1:8000"], EXIT_USAGE, "give a base URL"),
        (["check", "--target", "http://127.0.0.1:{closed}"], EXIT_UNREACHABLE, "cannot be reached"),
        (["check", "--allow-skip", "no such item"], EXIT_USAGE, "no check item 'no such item'"),
        (["load", "mixed", "--target", "127.0.0.1:8000"], EXIT_USAGE, "give a base URL"),
        (["replay", "/nonexistent/recorded.jsonl", "--target", "http://127.0.0.1:{closed}"], EXIT_FAILED, "No such"),
        (["node", "worker"], EXIT_USAGE, "needs the head's address"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
def test_a_bad_input_is_a_line_and_an_exit_code(
    arguments: list[str], code: int, message: str, not_yaml: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a.format(not_yaml=not_yaml, closed=_closed_port()) for a in arguments]
    assert main(argv) == code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "arguments",
    [["status"], ["down", "platform-x"], ["deploy", "topologies/teams/local-cpu.yaml"]],
    ids=" ".join,
)
def test_no_cluster_at_the_address_is_the_unreachable_exit(arguments: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sluice.cli.main", *arguments, "--address", f"127.0.0.1:{_closed_port()}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == EXIT_UNREACHABLE, result.stdout + result.stderr
    assert "no Ray cluster at" in result.stdout + result.stderr and "Traceback" not in result.stderr


def test_argparse_errors_are_the_usage_exit(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["canary", "x.yaml"], ["canary", "x.yaml", "--weight", "101"], ["nonsense"], ["load"]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == EXIT_USAGE
        assert "usage: sluice" in capsys.readouterr().err
