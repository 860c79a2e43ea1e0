"""`sluice load compare`: two runs' summaries side by side with B over A; a folder without a summary is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.compare import CompareError, compared_rows, read_summary


def _run(folder: Path, **figures: float) -> Path:
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps({"completed": 100, "failed": 0, **figures}))
    return folder


def test_each_figure_of_both_runs_gets_its_ratio(tmp_path: Path) -> None:
    a = read_summary(_run(tmp_path / "a", request_throughput=4.0, p99_ttft_ms=200.0, mean_itl_ms=10.0))
    b = read_summary(_run(tmp_path / "b", request_throughput=6.0, p99_ttft_ms=100.0))
    rows = {key: (first, second, ratio) for key, first, second, ratio in compared_rows(a, b)}
    assert rows["request_throughput"] == (4.0, 6.0, 1.5)
    assert rows["p99_ttft_ms"] == (200.0, 100.0, 0.5)
    assert rows["mean_itl_ms"] == (10.0, None, None), "a figure one run lacks has no ratio"
    assert rows["failed"] == (0.0, 0.0, None), "no ratio over 0"
    assert "median_tpot_ms" not in rows


def test_the_command_prints_both_runs_and_refuses_a_folder_without_a_summary(tmp_path: Path) -> None:
    a = _run(tmp_path / "a", request_throughput=4.0)
    b = _run(tmp_path / "b", request_throughput=2.0)
    command = [sys.executable, "-m", "sluice.cli.main", "load", "compare"]
    printed = subprocess.run([*command, str(a), str(b)], capture_output=True, text=True, check=True).stdout
    assert f"A: {a}" in printed and f"B: {b}" in printed
    assert any(line.split() == ["request_throughput", "4", "2", "0.5"] for line in printed.splitlines()), printed
    refused = subprocess.run([*command, str(a), str(tmp_path / "none")], capture_output=True, text=True)
    assert refused.returncode == 2 and "no campaign summary" in refused.stderr
    with pytest.raises(CompareError, match="not a `sluice load` summary"):
        (tmp_path / "other.json").write_text("{}")
        read_summary(tmp_path / "other.json")


def test_a_sweeps_summary_is_refused_naming_its_steps_folders(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    steps = [{"rate": 2.0, "folder": "rate-2"}, {"rate": 4.0, "folder": "rate-4"}]
    (sweep / "summary.json").write_text(json.dumps({"rates": [2.0, 4.0], "steps": steps}))
    with pytest.raises(
        CompareError, match=f"a rate sweep's summary; compare two of its steps' folders: {sweep}/rate-2"
    ):
        read_summary(sweep)
