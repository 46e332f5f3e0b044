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
