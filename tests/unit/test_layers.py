"""The folders are the layers: no module imports a package above its own (`sluice/layers.py`), and no modules or
folders import each other round a circle (`sluice/import_circles.py`)."""

from __future__ import annotations

import shutil
from pathlib import Path

from sluice.import_circles import circle_problems, circles
from sluice.layers import LAYERS, main, upward_imports

ROOT = Path(__file__).resolve().parents[2]


def _copy_of_the_tree(tmp_path: Path) -> None:
    for package in LAYERS:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))


def test_no_layer_imports_a_higher_one_and_nothing_imports_round_a_circle() -> None:
    assert upward_imports(ROOT) == []
    assert circle_problems(ROOT, LAYERS) == []
    assert main([str(ROOT)]) == 0


def test_two_planted_files_that_import_each_other_fail_the_check(tmp_path: Path) -> None:
    _copy_of_the_tree(tmp_path)
    # A lazy import closes the circle: it still ties the two modules together.
    (tmp_path / "routers" / "planted_a.py").write_text("from routers.planted_b import B\n\nA = 1\n")
    (tmp_path / "routers" / "planted_b.py").write_text(
        "def b() -> int:\n    from routers import planted_a\n\n    return 1\n"
    )
    assert circle_problems(tmp_path, LAYERS) == [
        "import circle of modules routers.planted_a, routers.planted_b: "
        "routers.planted_a -> routers.planted_b, routers.planted_b -> routers.planted_a"
    ]
    assert upward_imports(tmp_path) == [] and main([str(tmp_path)]) == 1


def test_two_folders_that_import_each_other_through_other_files_fail_the_check(tmp_path: Path) -> None:
    _copy_of_the_tree(tmp_path)
    # infra/observability imported infra/haproxy's AppRoute while infra/haproxy imports observability's targets.
    targets = tmp_path / "infra" / "observability" / "targets.py"
    targets.write_text(targets.read_text() + "\nfrom infra.haproxy.apps import AppRoute  # noqa: E402\n")
    assert circle_problems(tmp_path, LAYERS) == [
        "import circle of folders infra.haproxy, infra.observability: "
        "infra.haproxy -> infra.observability, infra.observability -> infra.haproxy"
    ]


def test_every_circle_is_found_whatever_its_length_and_one_way_paths_are_none() -> None:
    loop = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": set(), "f": {"f"}}
    assert circles(loop) == [["a", "b", "c"]]
    assert circles({"x": {"y"}, "y": {"z"}, "z": set()}) == []


def test_an_upward_import_fails_the_check(tmp_path: Path) -> None:
    _copy_of_the_tree(tmp_path)
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
    _copy_of_the_tree(tmp_path)
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
