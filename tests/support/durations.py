"""`python -m tests.support.durations JUNIT.xml ...`: the slowest tests of a run and its total, from the JUnit XML
files `make test` writes (each test's time there is its setup, call and teardown together). A file that a stopped run
never wrote is named and left out.

docs/environment.md keeps the table this prints (the 20 slowest before and after a change to the suite).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

SLOWEST = 20


@dataclass(frozen=True)
class CaseTime:
    nodeid: str
    seconds: float


def case_times(path: Path) -> list[CaseTime]:
    """Every test case of one JUnit file, named by its dotted module (and class) and its name."""
    root = ElementTree.parse(path).getroot()
    return [
        CaseTime(f"{case.get('classname')}::{case.get('name')}", float(case.get("time", 0)))
        for case in root.iter("testcase")
    ]


def table(times: list[CaseTime], count: int = SLOWEST) -> list[str]:
    """The `count` slowest tests as Markdown rows, then the total."""
    slowest = sorted(times, key=lambda t: t.seconds, reverse=True)[:count]
    rows = ["| s | test |", "|---:|---|"]
    rows += [f"| {t.seconds:.0f} | `{t.nodeid}` |" for t in slowest]
    rows.append(f"\n{len(times)} tests, {sum(t.seconds for t in times):.0f} s in all")
    return rows


def session_seconds(path: Path) -> float:
    """How long the file's pytest session ran, start to end (its tests' setups, calls and teardowns, and what lies
    between them)."""
    root = ElementTree.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    return float(suite.get("time", 0)) if suite is not None else 0.0


def main(paths: list[str]) -> int:
    times: list[CaseTime] = []
    sessions = []
    for path in map(Path, paths):
        if path.exists():
            times += case_times(path)
            sessions.append(f"{path.name} {session_seconds(path):.0f} s")
        else:
            print(f"{path}: not written (the run stopped before it)")
    print("\n".join(table(times)))
    print("sessions, start to end: " + ", ".join(sessions))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
