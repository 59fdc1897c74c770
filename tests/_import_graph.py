"""The static import graph of a package: which of its modules each module imports, and where.

Read from the source with ``ast``, so nothing is imported and every import counts wherever it is
written: at module level, inside a function (how import circles used to be hidden) and under
``if TYPE_CHECKING:`` (a type-only import that closes a circle hides the circle from the import
system, not from the reader: the two modules still need each other). Only a module's own
statements count: importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``, but counting
that would make every package ``__init__`` a hub that every submodule "imports".
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

import attrs

__all__ = ["Import", "circles", "imported_names", "imports", "modules"]


@attrs.frozen
class Import:
    """One import statement of ``source`` that names ``target`` (both modules of the package)."""

    source: str
    target: str
    path: str
    line: int
    lazy: bool  # inside a function
    type_only: bool  # under ``if TYPE_CHECKING:``

    def __str__(self) -> str:
        how = ", in a function" if self.lazy else ", TYPE_CHECKING only" if self.type_only else ""
        return f"{self.source} -> {self.target} ({self.path}:{self.line}{how})"


def modules(package_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """Every module of the package in ``package_dir``, by dotted name (packages by their own name)."""
    root = package_dir.parent
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """Every import statement in ``tree`` with (inside a function, under TYPE_CHECKING)."""

    def walk(
        node: ast.AST, lazy: bool, type_only: bool
    ) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, lazy, type_only
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from walk(child, True, type_only)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), lazy, True)
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), lazy, type_only)
            else:
                yield from walk(child, lazy, type_only)

    yield from walk(tree, False, False)


def _owner(name: str, known: dict[str, pathlib.Path]) -> str | None:
    """The module ``name`` lives in: itself, or the nearest enclosing module of the package."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imported_names(path: pathlib.Path) -> list[tuple[str, int]]:
    """Every absolute module name the file at ``path`` imports, anywhere in it, with its line
    (relative imports are left out: they cannot leave the package)."""
    found = []
    for node, _, _ in _statements(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif node.module and not node.level:
            found.append((node.module, node.lineno))
    return found


def imports(package_dir: pathlib.Path) -> list[Import]:
    """Every import, anywhere in a module of the package, of another module of the package."""
    known = modules(package_dir)
    found = []
    for source, path in known.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, lazy, type_only in _statements(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the package this module is in (or is)
                    here = source.split(".") if is_package else source.split(".")[:-1]
                    here = here[: len(here) - (node.level - 1)]
                    base = ".".join([*here, *([base] if base else [])])
                # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module.
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for name in names:
                target = _owner(name, known)
                if target is not None and target != source:
                    rel = path.relative_to(package_dir.parent).as_posix()
                    found.append(Import(source, target, rel, node.lineno, lazy, type_only))
    return found


def circles(edges: list[Import]) -> list[tuple[list[str], list[Import]]]:
    """Every strongly connected component of more than one module (Tarjan's), sorted, with one
    shortest import cycle through its first module."""
    graph: dict[str, dict[str, Import]] = {}
    for edge in edges:
        graph.setdefault(edge.source, {}).setdefault(edge.target, edge)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [(sorted(c), _cycle_in(sorted(c), graph)) for c in components]


def _cycle_in(component: list[str], graph: dict[str, dict[str, Import]]) -> list[Import]:
    """A shortest cycle through the component's first module, as the imports that make it."""
    start = component[0]
    members = set(component)
    came_from: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w, edge in sorted(graph.get(v, {}).items()):
                if w not in members or w in came_from:
                    continue
                came_from[w] = edge
                if w == start:
                    path = []
                    node = start
                    while True:
                        edge = came_from[node]
                        path.append(edge)
                        node = edge.source
                        if node == start:
                            return path[::-1]
                following.append(w)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {component}")  # a component always has one
