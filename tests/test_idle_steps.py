"""What a measuring callback costs on a step it neither measures nor logs (issue 36): no aten op and no host read
beyond those of the same fit without it, counted with a TorchDispatchMode over each training step (on a GPU every op
is a kernel launch, every read a synchronisation)."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

import lightning_precision as lp
from lightning_precision._upstream.torch import DispatchCounter
from lightning_precision.callbacks import GradientUnderflowMonitor, MFUMonitor
from tests.helpers import trainer

STEPS, MEASURE_EVERY = 8, 4


class _Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(batch).float().square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class _PerStep(L.Callback):
    """(aten ops, host reads) of each training step, from batch start to batch end. Listed last: it counts every other
    callback's hooks of the step but the batch-end ones of those listed after it (none)."""

    def __init__(self) -> None:
        self.counts: list[tuple[int, int]] = []
        self._counter: DispatchCounter | None = None

    def on_train_batch_start(self, *args: Any) -> None:
        self._counter = DispatchCounter()
        self._counter.__enter__()

    def on_train_batch_end(self, *args: Any) -> None:
        assert self._counter is not None
        self._counter.__exit__(None, None, None)
        self.counts.append((len(self._counter.names), self._counter.host_reads))


def _counts(plugin: Any, callbacks: list[L.Callback]) -> list[tuple[int, int]]:
    per_step = _PerStep()
    run = trainer(plugin, max_steps=STEPS, callbacks=[*callbacks, per_step], log_every_n_steps=100)
    run.fit(_Net(), torch.utils.data.DataLoader([torch.randn(8, 32)] * STEPS, batch_size=None))
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
