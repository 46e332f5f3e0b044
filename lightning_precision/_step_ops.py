"""StepOps: the aten ops and host reads of each training step of a Trainer fit, for the tests and benchmarks that hold
what a callback or a plugin adds to a step (on a GPU every aten op is a kernel launch, every read a synchronisation)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_precision._upstream.torch import DispatchCounter

__all__ = ["StepOps"]


class StepOps(Callback):
    """``counts``: (aten ops, host reads) of each training step, from its batch start to its batch end. List it last
    among the callbacks: it then counts every other callback's hooks of the step, but the batch-end ones of those
    listed after it (none)."""

    def __init__(self) -> None:
        self.counts: list[tuple[int, int]] = []
        self._counter: DispatchCounter | None = None

    @override
    def on_train_batch_start(self, *args: Any) -> None:
        self._counter = DispatchCounter()
        self._counter.__enter__()

    @override
    def on_train_batch_end(self, *args: Any) -> None:
        counter, self._counter = self._counter, None
        if counter is not None:
            counter.__exit__(None, None, None)
            self.counts.append((len(counter.names), counter.host_reads))

    @override
    def on_exception(self, *args: Any) -> None:
        if self._counter is not None:  # a step that raised: the mode is left, not kept on the stack
            self._counter.__exit__(None, None, None)
            self._counter = None
