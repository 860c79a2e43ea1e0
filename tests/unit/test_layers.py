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


def test_a_process_folder_importing_a_higher_or_sibling_one_fails_the_check(tmp_path: Path) -> None:
    for package in LAYERS:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    replica = tmp_path / "services" / "replica" / "vllm_app.py"
    legacy = tmp_path / "services" / "legacy" / "ingress.py"
    replica_lines = replica.read_text().splitlines()
    legacy_lines = legacy.read_text().splitlines()
    replica.write_text("\n".join([*replica_lines, "import services.frontend.app"]) + "\n")
    legacy.write_text("\n".join([*legacy_lines, "from services.router import service"]) + "\n")
    assert sorted(upward_imports(tmp_path)) == [
        f"services/legacy/ingress.py:{len(legacy_lines) + 1}: services/legacy (sub-layer 1) imports services/router "
        "(sub-layer 1): a layer may only import its own and lower ones",
        f"services/replica/vllm_app.py:{len(replica_lines) + 1}: services/replica (sub-layer 0) imports "
        "services/frontend (sub-layer 2): a layer may only import its own and lower ones",
    ]
