"""The slowest-tests table `make test` prints from its JUnit files."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.durations import case_times, main, table

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="3" time="50.7">
<testcase classname="tests.unit.test_a" name="test_quick" time="0.010" />
<testcase classname="tests.integration.test_b" name="test_slow[x]" time="42.5" />
<testcase classname="tests.integration.test_b.TestGroup" name="test_middle" time="3.2" />
</testsuite></testsuites>
"""


def test_the_table_lists_the_slowest_first_and_the_total(tmp_path: Path) -> None:
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    rows = table(case_times(path), count=2)
    assert rows[2:4] == [
        "| 42 | `tests.integration.test_b::test_slow[x]` |",
        "| 3 | `tests.integration.test_b.TestGroup::test_middle` |",
    ]
    assert rows[-1] == "\n3 tests, 46 s in all"


def test_a_file_a_stopped_run_never_wrote_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "junit-ray.xml")]) == 0
    assert "junit-ray.xml: not written" in capsys.readouterr().out


def test_each_session_says_how_long_it_ran(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each tier's session length, beside the tests' sum."""
    for name in ("junit-ray-own.xml", "junit-ray.xml"):
        (tmp_path / name).write_text(JUNIT)
    assert main([str(tmp_path / "junit-ray-own.xml"), str(tmp_path / "junit-ray.xml")]) == 0
    assert "sessions, start to end: junit-ray-own.xml 51 s, junit-ray.xml 51 s" in capsys.readouterr().out
