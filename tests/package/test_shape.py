"""The shape of the library, read from its source: no module over 600 lines, no class over 400, no function over 60
lines of code (blank lines, comments and docstrings not counted), and no ``backend ==`` dispatch of fp8 in the plugins
outside the one factory (``_core/fp8/backends.py``). Import cycles and import depth: tests/package/test_import_graph.py."""

from __future__ import annotations

import ast
import re

from tests.import_graph import modules

MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 600, 400, 60
SOURCES = {name: path.read_text() for name, path in modules().items()}


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value,
                                                                                                       str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def code_lines(source: str, node: ast.AST, docstrings: set[int]) -> int:
    """Lines of ``node`` (its decorators included) that hold code."""
    text = source.splitlines()
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return sum(1 for i in range(start, node.end_lineno + 1)
               if i not in docstrings and text[i - 1].strip() and not text[i - 1].strip().startswith("#"))


def oversized() -> list[str]:
    found = []
    for name, source in SOURCES.items():
        tree = ast.parse(source)
        if len(source.splitlines()) > MAX_MODULE:
            found.append(f"module {name}: {len(source.splitlines())} lines")
        docstrings = _docstring_lines(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS:
                found.append(f"class {name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = code_lines(source, node, docstrings)
                if n > MAX_FUNCTION:
                    found.append(f"function {name}.{node.name} (line {node.lineno}): {n} lines of code")
    return found


def test_no_module_class_or_function_past_its_size():
    assert oversized() == []


def test_the_counter_counts_code_only():
    source = 'def f():\n    """doc\n    string"""\n    # a comment\n\n    x = 1\n    return x\n'
    tree = ast.parse(source)
    assert code_lines(source, tree.body[0], _docstring_lines(tree)) == 3


def test_fp8_backends_are_chosen_in_one_place():
    """The plugins, their engine and the callbacks ask the backend object; the pure fp8 functions (the speed model,
    the hardware check) take the backend's name as an argument."""
    users = ("lightning_precision.fabric", "lightning_precision._core", "lightning_precision._trainer",
             "lightning_precision.callbacks")
    dispatching = [name for name, source in SOURCES.items()
                   if name.startswith(users) and name != "lightning_precision._core.fp8.backends"
                   and re.search(r"backend\s*[!=]=", source)]
    assert dispatching == [], "these modules dispatch on the fp8 backend's name: ask the backend object instead"
