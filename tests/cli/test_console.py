"""What the user sees on the console: no known-harmless noise from torchao's import, and our warnings attributed to the
user's own line rather than to Lightning's internals."""

import logging
import subprocess
import sys
import textwrap
import warnings

import lightning as L
import pytest
import torch

import lightning_precision
from lightning_precision import NoEffectWarning, _imports
from lightning_precision import fabric as lp_fabric
from lightning_precision._warnings import warn
from lightning_precision.callbacks import ChannelsLast
from tests.helpers import LitNet, loader, make_data, make_net, trainer

_TORCHAO = pytest.mark.skipif(not _imports.TORCHAO_AVAILABLE, reason="needs torchao (the [fp8] extra)")
_NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA torchao's kernel-load messages are kept")
NOISE = ("Failed to load", "_C_mxfp8", "_C_cutlass", "Skipping import of cpp extensions", "register_constant")


# torchao 0.18 beside torch 2.13 on a CPU prints all but the version message when imported plainly.
@_TORCHAO
@_NO_CUDA
@pytest.mark.parametrize(
    "code",
    [
        "from lightning_precision import FP8Precision; FP8Precision(emulate=True)",  # through `import_quietly`
        pytest.param(
            "from lightning_precision.cli.recipes import DistilBertClassifier; DistilBertClassifier()",  # via transformers
            marks=pytest.mark.skipif(not _imports.TRANSFORMERS_AVAILABLE, reason="needs transformers (core)"),
        ),
    ],
    ids=["fp8", "distilbert"],
)
def test_importing_torchao_through_the_package_prints_no_known_noise(code):
    # A fresh interpreter, where torchao really gets imported.
    done = subprocess.run([sys.executable, "-c", "import lightning_precision\n" + code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert not [line for line in done.stderr.splitlines() if any(n in line for n in NOISE)], done.stderr


def test_only_the_known_records_are_dropped_during_a_quiet_import(tmp_path, monkeypatch, caplog):
    # A module that logs, while imported, one of torchao's known records and an unrelated one on the same logger.
    (tmp_path / "noisy_dependency.py").write_text(textwrap.dedent("""
        import logging
        logging.getLogger("torchao").warning("Failed to load /site-packages/torchao/_C_mxfp8.abi3.so: no CUDA")
        logging.getLogger("torchao").warning("torchao: something else went wrong")
        logging.getLogger("torch.utils._pytree").warning(
            "<enum 'X'> is an Enum subclass and is now natively supported by torch.compile as an opaque value type."
            " Calling register_constant() on Enum subclasses is deprecated and will be an error in a future release."
        )
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING):
        _imports.import_quietly("noisy_dependency")
    kept = [r.getMessage() for r in caplog.records]
    assert "torchao: something else went wrong" in kept
    assert not any("register_constant" in m for m in kept)
    assert any("Failed to load" in m for m in kept) == torch.cuda.is_available()  # may matter on a GPU machine
    # The filters are gone after the import.
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load /site-packages/torchao/_C_mxfp8.abi3.so: later")
    assert [r.getMessage() for r in caplog.records] == ["Failed to load /site-packages/torchao/_C_mxfp8.abi3.so: later"]


@_TORCHAO
def test_no_effect_warning_of_a_trainer_fit_points_at_the_users_line():
    plugin = lightning_precision.FP8Precision(emulate=True)  # every layer of LitNet is too small for fp8
    with pytest.warns(NoEffectWarning, match="no linear layer runs in fp8") as record:
        trainer(plugin, max_steps=1).fit(LitNet(), loader(make_data(1)))
    assert [w.filename for w in record if w.category is NoEffectWarning] == [__file__]


@_TORCHAO
def test_no_effect_warning_of_a_fabric_setup_points_at_the_users_line():
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[lp_fabric.FP8Precision(emulate=True)])
    with pytest.warns(NoEffectWarning, match="no linear layer runs in fp8") as record:
        fabric.setup(make_net())
    assert [w.filename for w in record if w.category is NoEffectWarning] == [__file__]


def test_callback_warning_points_at_the_users_line():
    with pytest.warns(NoEffectWarning, match="^ChannelsLast: .*no 2-d or 3-d convolution") as record:
        trainer(None, max_steps=1, callbacks=[ChannelsLast()]).fit(LitNet(), loader(make_data(1)))
    assert [w.filename for w in record if w.category is NoEffectWarning] == [__file__]


def test_warn_is_silent_on_other_ranks(monkeypatch):
    from lightning_utilities.core.rank_zero import rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", 1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        warn("every rank would say this", NoEffectWarning)
    assert record == []
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    with pytest.warns(NoEffectWarning, match="every rank") as record:
        warn("every rank would say this", NoEffectWarning)
    assert record[0].filename == __file__
