"""The package's import graph, read from the source: every import statement (lazy ones in functions included), or
only those that run when the module is imported (its top level, `if TYPE_CHECKING:` blocks left out).

``python -m tests.import_graph`` prints the cycles and the longest chain of both."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_precision"


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _import_time(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements that run when the module is imported: its top level and the branches of its ``if`` and ``try``
    blocks, without ``if TYPE_CHECKING:`` (for type checkers only) and without function or class bodies."""
    found: list[ast.stmt] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            found += _import_time(node.body) + _import_time(node.orelse)
        elif isinstance(node, ast.Try):
            found += _import_time(node.body) + _import_time(node.orelse) + _import_time(node.finalbody)
            for handler in node.handlers:
                found += _import_time(handler.body)
    return found


def graph(lazy: bool = True) -> dict[str, set[str]]:
    """Each module and the package modules it imports: `from a import b` counts as importing `a.b` when that is a
    module, else `a`. ``lazy=False``: only the imports that run when the module is imported."""
    mods = modules()
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        is_package = path.name == "__init__.py"
        targets = set()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree) if lazy else _import_time(tree.body):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative
                    base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                for a in node.names:
                    targets.add(f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module)
        edges[name] = {t for t in targets if t in mods and t != name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def levels(edges: dict[str, set[str]]) -> tuple[int, list[str]]:
    """The longest chain of imports (in modules) and one such chain; the graph must have no cycle."""

    @functools.cache
    def chain(v: str) -> tuple[str, ...]:
        return (v, *max((chain(w) for w in edges[v]), key=len, default=()))

    longest = max((chain(v) for v in edges), key=len)
    return len(longest), list(longest)


if __name__ == "__main__":
    for lazy in (True, False):
        e = graph(lazy)
        print("every import" if lazy else "import time", "- modules:", len(e), "cycles:", cycles(e))
        if not cycles(e):
            depth, chain = levels(e)
            print(f"  {depth} levels:", " -> ".join(chain))
