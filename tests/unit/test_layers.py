"""The folders are the layers: no module imports a package above its own (`sluice/layers.py`)."""

from __future__ import annotations

import shutil
from pathlib import Path

from sluice.layers import LAYERS, main, upward_imports

ROOT = Path(__file__).resolve().parents[2]


def test_no_layer_imports_a_higher_one() -> None:
    assert upward_imports(ROOT) == []
    assert main([str(ROOT)]) == 0


def test_an_upward_import_fails_the_check(tmp_path: Path) -> None:
    for package in LAYERS:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    contracts = tmp_path / "base" / "contracts.py"
    lines = contracts.read_text().splitlines()
    # Deep inside a function counts too: a lazy import still couples the layers.
    contracts.write_text(
        "\n".join([*lines, "", "def _helper():", "    from services.replica import llm_replica"]) + "\n"
    )
    problems = upward_imports(tmp_path)
    assert problems == [
        f"base/contracts.py:{len(lines) + 3}: base (layer 0) imports services (layer 3): "
        "a layer may only import its own and lower ones"
    ]
    assert main([str(tmp_path)]) == 1
