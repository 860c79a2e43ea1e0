"""The README and its docs/ pages stay true: the README is one short first screen, every `sluice`, `make` and
`ray start` command in its shell blocks is one the code accepts as written, every relative link (and heading anchor)
of the README and docs/ lands, and the data plane page's table of the frontend's own statuses matches the contracts
module."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from base import contracts
from base.runtime import COMPATIBLE_RAY_START
from sluice.cli.main import build_parser
from topologies import EMBEDDED_SPEC, TEAMS_DIR
from topologies.platform import is_platform_file, load_platform

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 200
# Shell tokens that end a command's own arguments (what follows is a redirect, a pipe or the next command).
SHELL_OPERATORS = {">", ">>", "<", "|", "||", "&", "&&", ";", "2>", "2>&1"}
FENCE = re.compile(r"^ *```(sh|bash)\n(.*?)^ *```", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _shell_lines(text: str) -> list[str]:
    """Each command line of the text's sh/bash blocks: continuations joined, comments and blank lines dropped."""
    found = []
    for block in FENCE.finditer(text):
        joined = re.sub(r"\\\n\s*", " ", block[2])
        found += [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]
    return found


def _words(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def _invocations(program: str, text: str) -> list[tuple[str, list[str]]]:
    """(line, argv) for each shell line that runs `program` (bare or by a path such as `.venv/bin/sluice`)."""
    found = []
    for line in _shell_lines(text):
        words = _words(line)
        for index, word in enumerate(words):
            if word == program or word.endswith(f"/{program}"):
                argv = []
                for argument in words[index + 1 :]:
                    if argument in SHELL_OPERATORS:
                        break
                    argv.append(argument)
                found.append((line, argv))
                break
    return found


def _readme() -> str:
    return README.read_text()


def test_the_readme_is_one_short_first_screen() -> None:
    lines = len(_readme().splitlines())
    assert lines < MAX_README_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_every_sluice_command_in_the_readme_parses() -> None:
    commands = _invocations("sluice", _readme())
    assert len(commands) >= 10, f"only {len(commands)} sluice commands found in the README's sh blocks"
    for line, argv in commands:
        try:
            build_parser().parse_args(argv)
        except SystemExit as exit_:
            if exit_.code not in (0, None):
                pytest.fail(f"README: `sluice` rejects this line: {line}")


def test_every_team_file_and_stack_the_readme_names_exists() -> None:
    specs = [yaml.safe_load(path.read_text()) for path in TEAMS_DIR.glob("*.yaml")]
    stacks = {f"{spec['team']}-{spec['name']}" for spec in specs}
    stacks |= {
        load_platform(path).stack
        for path in (ROOT / "topologies" / "platforms").glob("*.yaml")
        if is_platform_file(path)
    }
    for line, argv in _invocations("sluice", _readme()):
        for word in argv:
            if word.startswith("topologies/"):
                assert (ROOT / word).is_file(), f"README: no file {word}: {line}"
        if argv[0] in ("status", "down") and len(argv) > 1 and not argv[1].startswith("-"):
            assert argv[1] in stacks or (ROOT / argv[1]).is_file(), f"README: no stack {argv[1]}: {line}"


def test_the_quickstart_runs_the_embedded_default_on_the_ray_start_the_integration_tests_use() -> None:
    text = _readme()
    assert EMBEDDED_SPEC.relative_to(ROOT).as_posix() == "topologies/teams/local-cpu.yaml"
    env, command = COMPATIBLE_RAY_START.split(" ", 1)
    assert f"{env} .venv/bin/{command}" in _shell_lines(text), "README: the quickstart's `ray start` line changed"
    steps = [argv[0] for _, argv in _invocations("sluice", text) if "topologies/teams/local-cpu.yaml" in argv]
    assert {"validate", "deploy", "check"} <= set(steps)


def test_every_make_command_in_the_readme_names_a_target_and_its_variables() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, re.M))
    variables = set(re.findall(r"^([A-Z_]+)\s*[?:]?=", makefile, re.M))
    commands = _invocations("make", _readme())
    assert {"serve", "test"} <= {word for _, argv in commands for word in argv}
    for line, argv in commands:
        for word in argv:
            name = word.split("=", 1)[0]
            assert (name in variables) if "=" in word else (word in targets), f"README: make knows no {name}: {line}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped but `-` and `_`, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^ *```.*?^ *```", "", page.read_text(), flags=re.M | re.S)
    return {_slug(heading) for heading in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", [README, *sorted(DOCS.glob("*.md"))], ids=lambda page: page.name)
def test_every_relative_link_lands(page: Path) -> None:
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        landing = (page.parent / path).resolve() if path else page
        assert landing.exists(), f"{page.name}: the link {target} leads nowhere"
        if anchor and landing.suffix == ".md":
            assert anchor in _anchors(landing), f"{page.name}: {landing.name} has no heading #{anchor}"


def test_the_readme_links_every_docs_page() -> None:
    linked = {target.split("#")[0] for target in LINK.findall(_readme())}
    for page in sorted(DOCS.glob("*.md")):
        assert f"docs/{page.name}" in linked, f"README links no docs/{page.name}"


def _status_rows() -> dict[str, str]:
    text = (DOCS / "data-plane.md").read_text()
    section = text[text.index("### Every status the frontend returns itself") :]
    section = section.split("\n## ", 1)[0]
    return {m[1]: m[2] for m in re.finditer(r"^\| ([^|]+?) \| ([^|]+?) \|", section, re.M)}


def test_every_frontend_status_is_listed_with_its_reason() -> None:
    rows = _status_rows()
    pairs = [
        *contracts.HAPROXY_ERROR_REASONS.items(),
        *contracts.PROTECTION_REASONS.items(),
        *((503, reason) for reason in contracts.FAIL_CLOSED_REASONS),
    ]
    for status, reason in pairs:
        assert str(status) in rows, f"docs/data-plane.md lists no {status}"
        assert f"`{reason}`" in rows[str(status)], f"docs/data-plane.md: {status} without `{reason}`"
    assert f"`{contracts.REASON_REPLICA_ERROR}`" in rows["a replica's 5xx"]


def test_every_status_the_platform_returns_itself_is_listed_with_its_reason() -> None:
    text = (ROOT / "services" / "platform" / "README.md").read_text()
    section = text[text.index("### Every status the platform returns itself") :]
    rows = {m[1]: m[2] for m in re.finditer(r"^\| ([^|]+?) \| ([^|]+?) \|", section, re.M)}
    pairs = [*((status, reason) for reason, status in contracts.PLATFORM_REASONS.items())]
    pairs += [(401, contracts.REASON_INVALID_API_KEY), (404, contracts.REASON_MODEL_NOT_FOUND)]
    for status, reason in pairs:
        assert f"`{reason}`" in rows[str(status)], f"services/platform/README.md: {status} without `{reason}`"
