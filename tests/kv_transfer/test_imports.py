"""kv_transfer's modules form no import circle: no module imports one that (transitively)
imports it back, counting imports inside functions and under TYPE_CHECKING."""

from __future__ import annotations

import ast
from pathlib import Path

import fleetserve.kv_transfer

PACKAGE = "fleetserve.kv_transfer"
ROOT = Path(fleetserve.kv_transfer.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports anywhere (`from a import b` counts a.b when
    that is a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found & modules


def import_graph() -> dict[str, set[str]]:
    paths = sorted(ROOT.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    # A package's __init__ is imported by each of its modules anyway: only edges between
    # modules count.
    return {_module_name(p): _imports(p, modules) - {_module_name(p), PACKAGE} for p in paths}


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    circles = []
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            mod = todo.pop()
            if mod == start:
                circles.append(start)
                break
            if mod not in seen:
                seen.add(mod)
                todo.extend(graph.get(mod, ()))
    assert not circles, f"modules in an import circle: {sorted(circles)}"
