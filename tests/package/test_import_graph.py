"""The package's import graph, read from the source: no cycle, even through an import inside a function, and no
chain of imports that run at import time deeper than a newcomer can follow."""

from tests import import_graph

MAX_LEVELS = 8


def test_no_module_imports_itself_through_others():
    assert import_graph.cycles(import_graph.graph()) == []


def test_at_most_eight_levels():
    depth, chain = import_graph.levels(import_graph.graph(lazy=False))
    assert depth <= MAX_LEVELS, " -> ".join(chain)


def test_the_library_never_imports_the_tool():
    """`lightning_precision.cli` (compare, doctor, plan, fit, recipes) sits on the library; nothing below it imports
    it, so a plugin user needs none of the `cli` extra."""
    edges = import_graph.graph()
    into_tool = {(a, b) for a, b_set in edges.items() for b in b_set
                 if b.startswith("lightning_precision.cli") and not a.startswith("lightning_precision.cli")}
    assert into_tool == set()


def test_the_library_imports_none_of_the_tools_dependencies():
    """The core dependencies are torch, Lightning, typing-extensions and PyYAML: no library module imports what the
    `cli` extra installs, and matplotlib (the `plots` extra) only in the module that draws the callbacks' plots,
    after `_imports` says how to install it."""
    import ast

    tool_only = {"jsonargparse", "rich", "transformers", "torchmetrics", "datasets", "matplotlib"}
    found = set()
    for name, path in import_graph.modules().items():
        if name.startswith("lightning_precision.cli"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found |= {(name, n.split(".")[0]) for n in names if n.split(".")[0] in tool_only}
    assert found == {("lightning_precision._plots", "matplotlib")}


def test_the_pure_parts_import_no_lightning():
    """`functional` (the pure functions), `formats` and `fp8` (plans, choice, sensitivity) work on tensors and modules
    alone: importing them loads no Lightning module (it once took 3.2 s and 44 modules, for one constant)."""
    import subprocess
    import sys

    code = ("import sys; import lightning_precision.functional, lightning_precision.formats, lightning_precision.fp8;"
            " print(sorted(m for m in sys.modules if m == 'lightning' or m.startswith('lightning.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
