"""No import cycle inside the package: module-level imports (``TYPE_CHECKING`` blocks included) between
moetune modules form a directed acyclic graph. Imports inside functions are the package's lazy imports
(they keep ``import moetune`` cheap) and do not count."""

from __future__ import annotations

import ast
from pathlib import Path

import moetune

PACKAGE = Path(moetune.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_level_imports(tree: ast.Module, modules: set[str]) -> set[str]:
    """The moetune modules imported at module level (inside ``if`` / ``try`` blocks too, not inside
    functions). ``from pkg import name`` imports ``pkg.name`` when that is a module, else ``pkg``."""
    found: set[str] = set()
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                for a in node.names
            }
        elif isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", [])
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]
    return found & modules


def import_graph() -> dict[str, set[str]]:
    """module -> the moetune modules it imports at module level; a module's own parent packages (which
    Python is already initialising when it runs) are no edge."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {
        name: {
            m
            for m in module_level_imports(ast.parse(path.read_text()), set(files))
            if m != name and not name.startswith(m + ".")
        }
        for name, path in files.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    assert len(graph) > 50 and graph["moetune.loading.load"]  # the graph really was read
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_store_is_below_loading():
    """``moetune.loading`` imports ``moetune.store``, never the other way (lazy imports included)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    for name, path in files.items():
        if name.startswith("moetune.store"):
            every = {
                n.module
                for n in ast.walk(ast.parse(path.read_text()))
                if isinstance(n, ast.ImportFrom) and n.module
            } | {
                a.name
                for n in ast.walk(ast.parse(path.read_text()))
                if isinstance(n, ast.Import)
                for a in n.names
            }
            assert not {m for m in every if m.startswith("moetune.loading")}, name
