"""The seam between the Trainer and the Fabric classes (``lightning_precision/_trainer/seam.py``): the methods by which
Lightning's Trainer ``Precision`` hides the Fabric class's (it overrides them without calling ``super()``) are exactly
the ones ``SHADOWED`` names, with the parameters it records, read from the installed Lightning; and under every Trainer
plugin each of them resolves to our re-implementation wherever the Fabric class does something in it."""

import ast
import inspect
import textwrap

from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision

from lightning_precision._trainer import seam
from tests.plugin_tester import TRAINER_PLUGINS


def _calls_super(function) -> bool:
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
               for node in ast.walk(tree))


def lightnings_shadowing_methods() -> dict[str, tuple[str, ...]]:
    """Methods of Lightning's Trainer ``Precision`` that override the Fabric ``Precision``'s without ``super()``."""
    return {name: tuple(inspect.signature(function).parameters)
            for name, function in vars(TrainerPrecision).items()
            if inspect.isfunction(function) and hasattr(FabricPrecision, name) and not _calls_super(function)}


def _owner(cls: type, name: str) -> type:
    return next(c for c in cls.__mro__ if name in vars(c))


def test_the_seam_names_every_method_lightning_hides_with_its_parameters():
    assert lightnings_shadowing_methods() == seam.SHADOWED, (
        "Lightning's Trainer Precision now hides other Fabric methods (or takes other parameters): re-implement them in"
        " lightning_precision/_trainer/seam.py and update SHADOWED")


def test_each_hidden_method_runs_ours_wherever_the_fabric_class_has_one():
    checked = 0
    for cls in TRAINER_PLUGINS:
        fabric_class = next(c for c in cls.__mro__ if issubclass(c, FabricPrecision)
                            and not issubclass(c, TrainerPrecision) and c.__module__.startswith("lightning_precision"))
        for name in seam.SHADOWED:
            if _owner(fabric_class, name).__module__.startswith("lightning_precision"):  # the Fabric class acts there
                owner = _owner(cls, name)
                assert owner.__module__.startswith("lightning_precision._trainer"), (cls, name, owner)
                checked += 1
    assert checked >= 2 * len(TRAINER_PLUGINS)  # backward and optimizer_step, at least, for every plugin


def test_the_seam_says_what_it_does_for_each():
    for name in seam.SHADOWED:
        assert f"``{name}``" in seam.__doc__, name
