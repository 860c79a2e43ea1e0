"""Import circles: modules (files) or folders of sluice that import each other, directly or round a longer loop.

Every import counts, lazy and type-checking ones included: each still ties the two modules together. The graph's
nodes are the modules of `LAYERS` (`routers.kv_aware`); `from routers import kv_aware` is an edge to the module when
it is a file, else to the package. A circle is a strongly connected component of more than one node (Tarjan's
algorithm, linear in the edges), reported with the edges that close it. Folders are checked the same way, with each
module standing for the folder it lies in (`infra.haproxy`), so two folders that import each other through different
files show too. `python -m sluice.layers` runs both checks.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

Graph = Mapping[str, set[str]]


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(tree: ast.AST) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, module, names) of every absolute import in a module, lazy ones included: `import a.b` gives
    (line, "a.b", ()), `from a import x, y` gives (line, "a", ("x", "y"))."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module, tuple(alias.name for alias in node.names)))
    return found


def _targets(module: str, names: tuple[str, ...], known: set[str]) -> Iterable[str]:
    """The known modules one import names: each `from` name that is a module, else the module it is taken from."""
    if not names:
        if module in known:
            yield module
        return
    for name in names:
        child = f"{module}.{name}"
        if child in known:
            yield child
        elif module in known:
            yield module


def module_graph(root: Path, packages: Iterable[str]) -> dict[str, set[str]]:
    """{module: the modules it imports} over every `.py` file of `packages` under `root`."""
    paths = {_module_name(root, path): path for package in packages for path in sorted((root / package).rglob("*.py"))}
    known = set(paths)
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[module] = {
            target for _, imported, names in imports_of(tree) for target in _targets(imported, names, known)
        } - {module}
    return graph


def _related(a: str, b: str) -> bool:
    """One folder holds the other (or they are the same)."""
    return a == b or a.startswith(f"{b}.") or b.startswith(f"{a}.")


def folder_graph(modules: Graph) -> dict[str, set[str]]:
    """The same imports between the folders the modules lie in (a package's `__init__` lies in its own folder).
    Imports between a folder's own modules and its sub-folders are left out: they are one package, ordered by
    `SUB_LAYERS` where it matters (`sluice.layers`)."""

    def folder(module: str) -> str:
        return module if module in packages else module.rpartition(".")[0]

    packages = {module for module in modules if any(other.startswith(f"{module}.") for other in modules)}
    graph: dict[str, set[str]] = {folder(module): set() for module in modules}
    for module, imported in modules.items():
        graph[folder(module)] |= {folder(t) for t in imported if not _related(folder(t), folder(module))}
    return graph


def circles(graph: Graph) -> list[list[str]]:
    """Every strongly connected component of more than one node, each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def circle_problems(root: Path, packages: Iterable[str]) -> list[str]:
    """One line per circle, of files and then of folders: its members and the imports inside it."""
    modules = module_graph(root, packages)
    problems = []
    for kind, graph in (("modules", modules), ("folders", folder_graph(modules))):
        for members in circles(graph):
            inside = set(members)
            edges = ", ".join(f"{a} -> {b}" for a in members for b in sorted(graph[a] & inside))
            problems.append(f"import circle of {kind} {', '.join(members)}: {edges}")
    return problems
