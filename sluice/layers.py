"""sluice's layers: a module imports its own package and the packages below it, never above (docs/design.md §2).

Packages, lowest first: `LAYERS`. Inside `services/` and `sluice/` the sub-folders are layers too (`SUB_LAYERS`):
a process folder imports the package's own top-level modules (`services/serve_internals.py`), its own folder and
lower folders only. No two modules, nor two folders, import each other round a circle (`sluice.import_circles`).
`python -m sluice.layers [ROOT]` lists every upward import and every circle, lazy imports included, and exits 1 if
there is one; `make lint` and `make test` run it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from sluice.import_circles import circle_problems, imports_of

LAYERS = ("base", "routers", "infra", "services", "topologies", "builders", "loadtests", "sluice")
# The replica serves alone; the router ranks replicas (their config); the legacy ingress calls replicas; the frontend
# asks the routers; a platform's frontend sits in front of the stacks' frontends. Equal ranks do not import each other.
SUB_LAYERS = {
    "services": {"replica": 0, "router": 1, "legacy": 1, "frontend": 2, "platform": 3},
    "sluice": {"deploy": 0, "bench": 1, "cli": 2},
}
_RANK = {package: rank for rank, package in enumerate(LAYERS)}


def _sub_layer(package: str, parts: list[str]) -> str | None:
    """The sub-folder of `package` a module path (parts after the package) lies in; None for a top-level module."""
    if package not in SUB_LAYERS or not parts or parts[0] not in SUB_LAYERS[package]:
        return None
    return parts[0]


def _problem(package: str, own_sub: str | None, imported: str) -> str | None:
    top, *rest = imported.split(".")
    if top not in _RANK:
        return None
    if _RANK[top] > _RANK[package]:
        return f"{package} (layer {_RANK[package]}) imports {top} (layer {_RANK[top]})"
    imported_sub = _sub_layer(top, rest)
    if top != package or imported_sub is None or imported_sub == own_sub:
        return None
    if own_sub is None:
        return f"{package}'s top-level modules (below its folders) import {package}/{imported_sub}"
    ranks = SUB_LAYERS[package]
    if ranks[imported_sub] >= ranks[own_sub]:
        return (
            f"{package}/{own_sub} (sub-layer {ranks[own_sub]}) imports {package}/{imported_sub} "
            f"(sub-layer {ranks[imported_sub]})"
        )
    return None


def upward_imports(root: Path) -> list[str]:
    """Every import of a higher layer, as `path:line: <who> (layer i) imports <what> (layer j): ...`."""
    problems = []
    for package in LAYERS:
        for path in sorted((root / package).rglob("*.py")):
            own_sub = _sub_layer(package, list(path.relative_to(root / package).parts[:-1]))
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, imported, _ in imports_of(tree):
                if (problem := _problem(package, own_sub, imported)) is not None:
                    problems.append(
                        f"{path.relative_to(root)}:{line}: {problem}: a layer may only import its own and lower ones"
                    )
    return problems


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0]) if args else Path(__file__).resolve().parents[1]
    problems = upward_imports(root) + circle_problems(root, LAYERS)
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(
            f"layers: no upward import ({' < '.join(LAYERS)}; inside services and sluice: {SUB_LAYERS}), "
            "no import circle"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
