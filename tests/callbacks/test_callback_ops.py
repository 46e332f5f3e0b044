"""What a measuring callback adds to a training step (issue 36), counted with a TorchDispatchMode against the same fit
without it (on a GPU every aten op is a kernel launch, every host read a synchronisation): nothing on a step it neither
measures nor logs; for AmaxHistoryLogger, which records every step, at most 3 ops per linear layer and no read."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

import lightning_precision as lp
from lightning_precision._step_ops import StepOps
from lightning_precision.callbacks import AmaxHistoryLogger, GradientUnderflowMonitor, MFUMonitor
from tests.helpers import trainer

STEPS, MEASURE_EVERY = 8, 4


class _Net(L.LightningModule):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*[nn.Linear(32, 32) for _ in range(layers)])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(batch).float().square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _counts(plugin: Any, callbacks: list[L.Callback], layers: int = 4, steps: int = STEPS) -> list[tuple[int, int]]:
    per_step = StepOps()
    run = trainer(plugin, max_steps=steps, callbacks=[*callbacks, per_step], log_every_n_steps=100)
    run.fit(_Net(layers), torch.utils.data.DataLoader([torch.randn(8, 32)] * steps, batch_size=None))
    return per_step.counts


CALLBACKS = {
    "GradientUnderflowMonitor": lambda: GradientUnderflowMonitor(measure_every_n_steps=MEASURE_EVERY,
                                                                log_every_n_steps=100),
    "MFUMonitor": lambda: MFUMonitor(flops_per_batch=1e6, peak_tflops=1.0, log_every_n_steps=100),
}


@pytest.mark.parametrize("plugin", [lp.BF16MixedPrecision, lp.FP16MixedPrecision])
@pytest.mark.parametrize("name", sorted(CALLBACKS))
def test_a_step_the_callback_neither_measures_nor_logs_costs_no_op_and_no_read(name, plugin):
    alone = _counts(plugin(), [])
    beside = _counts(plugin(), [CALLBACKS[name]()])
    measured = {i for i in range(STEPS) if (i + 1) % MEASURE_EVERY == 0} if name == "GradientUnderflowMonitor" else set()
    idle = [i for i in range(STEPS) if i not in measured]
    assert [beside[i] for i in idle] == [alone[i] for i in idle], (beside, alone)
    if measured:  # the count sees the measuring steps: the test is not vacuous
        assert all(beside[i][0] > alone[i][0] for i in measured), (beside, alone)


@pytest.mark.parametrize("ops_cheap", [True, False], ids=["cpu-policy", "accelerator-policy"])
def test_the_amax_logger_adds_at_most_three_ops_a_linear_layer_and_no_read(ops_cheap, monkeypatch):
    """An activation's amax must be taken before it is freed: one reduction per input and per output gradient. The
    weights' are one `_foreach_norm` for all layers on an accelerator (a CPU takes one `aminmax` each: there an op is a
    call, and the fused norm writes |w| first), and the ring one write per step. Counted at 4 and 16 layers, the
    difference is the cost per layer; what is left is constant."""
    monkeypatch.setattr("lightning_precision.callbacks.amax.ops_are_cheap", lambda device: ops_cheap)
    added = {}
    for layers in (4, 16):
        alone = _counts(lp.BF16MixedPrecision(), [], layers, steps=4)
        beside = _counts(lp.BF16MixedPrecision(), [AmaxHistoryLogger(log_every_n_steps=100)], layers, steps=4)
        # the first step makes the step's write plan (a host-to-device copy, once): the ordinary steps follow it
        added[layers] = {(b[0] - a[0], b[1] - a[1]) for a, b in zip(alone[1:], beside[1:], strict=True)}
        assert len(added[layers]) == 1, added  # the same every ordinary step
    (ops4, reads4), (ops16, reads16) = added[4].pop(), added[16].pop()
    assert reads4 == reads16 == 0
    per_layer = (ops16 - ops4) / 12
    assert per_layer == (3 if ops_cheap else 2), (ops4, ops16)
    assert ops4 - 4 * per_layer <= 20, (ops4, ops16)  # the constant part: the flush and the ring write


def _fp8(**kw: Any) -> Any:
    return lp.FP8Precision(emulate=True, skip_small_layers=False, skip_first_last=False, **kw)


def test_fp8_guard_adds_no_op_and_no_read_on_a_step_it_does_not_measure():
    pytest.importorskip("torchao")
    from lightning_precision.callbacks import FP8Guard

    alone = _counts(_fp8(), [])
    beside = _counts(_fp8(), [FP8Guard(every_n_steps=MEASURE_EVERY)])
    measured = {i for i in range(STEPS) if (i + 1) % MEASURE_EVERY == 0}
    idle = [i for i in range(STEPS) if i not in measured]
    assert [beside[i] for i in idle] == [alone[i] for i in idle], (beside, alone)
    assert all(beside[i][0] > alone[i][0] for i in measured), (beside, alone)  # not vacuous


def test_layers_auto_costs_nothing_once_it_has_decided():
    """After its calibration batches, ``layers="auto"`` runs as the plan it chose given outright: the same ops and
    reads every step (the measuring batches cost what measuring costs)."""
    pytest.importorskip("torchao")
    auto = _fp8(layers="auto", calibration_batches=2)
    chosen = _counts(auto, [])
    plan = auto.plan_in_force()
    assert plan is not None and any(entry.low for entry in plan.layers)  # it chose fp8 for some
    given = _counts(_fp8(layers=plan), [])
    assert chosen[2:] == given[2:], (chosen, given)
    assert chosen[0][0] > given[0][0]  # the count sees the measuring: the test is not vacuous
