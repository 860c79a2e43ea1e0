"""sluice's layers, lowest first: a module may import its own package and the packages below it, never above.

| layer | package | holds |
|---|---|---|
| 0 | `base/` | the wire contract (headers, reasons, defaults), wire formats, runtime environment, tiny model |
| 1 | `routers/` | routing policies (pure core) and their Ray adapters, the capacity ledger actor |
| 2 | `infra/` | HAProxy config, Lua, process control, runtime API client, API key lists |
| 3 | `services/` | processes: LLM replica, router service, HAProxy syncer, key watcher, Serve endpoint discovery |
| 4 | `topologies/` | team topology specs |
| 5 | `builders/` | stacks composed from specs |
| 6 | `loadtests/` | load tools |
| 7 | `sluice/` | the CLI, benchmarks, the local cluster |

`python -m sluice.layers [ROOT]` lists every upward import (absolute imports, at any depth of a module) and exits
1 if there is one; `make lint` and `make test` run it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

LAYERS = ("base", "routers", "infra", "services", "topologies", "builders", "loadtests", "sluice")
_RANK = {package: rank for rank, package in enumerate(LAYERS)}


def _imported_packages(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in a module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def upward_imports(root: Path) -> list[str]:
    """Every import of a higher layer, as `path:line: <package> (layer i) imports <package> (layer j)`."""
    problems = []
    for package in LAYERS:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, imported in _imported_packages(tree):
                if imported in _RANK and _RANK[imported] > _RANK[package]:
                    problems.append(
                        f"{path.relative_to(root)}:{line}: {package} (layer {_RANK[package]}) imports "
                        f"{imported} (layer {_RANK[imported]}): a layer may only import its own and lower ones"
                    )
    return problems


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0]) if args else Path(__file__).resolve().parents[1]
    problems = upward_imports(root)
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"layers: no upward import ({' < '.join(LAYERS)})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
