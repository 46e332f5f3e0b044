"""The ``Example:`` sections in the docstrings of the measuring functions, the formats and fp8 layer selection run as
doctests, and every public function or class of ``functional`` and ``formats`` comes with one."""

import doctest
import inspect

import pytest
import torch

from lightning_precision import _channels_last, _launches, formats, functional
from lightning_precision.fp8 import _decision, _plan, _plan_types, _selection

# The fewest examples each module must run: the count written, so that losing examples fails here.
EXAMPLES = {functional: 40, _channels_last: 7, formats: 20, _selection: 7, _plan: 1, _plan_types: 2, _decision: 1,
            _launches: 1}


@pytest.mark.parametrize("module", list(EXAMPLES), ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
    with torch.random.fork_rng(devices=[]):  # the examples build layers: leave the global generator as it was
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {module.__name__} failed (above)"
    assert result.attempted >= EXAMPLES[module], f"{module.__name__}: {result.attempted} examples run"


def _public(module):
    return {
        name: obj
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(obj) or inspect.isclass(obj))
        and obj.__module__ == module.__name__
    }


@pytest.mark.parametrize("module", [functional, formats], ids=lambda m: m.__name__)
def test_public_callables_have_an_example(module):
    public = _public(module)
    assert public  # the filter found the module's own functions and classes
    missing = sorted(name for name, obj in public.items() if ">>>" not in (obj.__doc__ or ""))
    assert not missing, f"{module.__name__}: public functions or classes without a `>>>` example: {missing}"
