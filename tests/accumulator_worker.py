"""One rank of the accumulator's cross-process tests (``tests/distributed.py`` starts the ranks): gloo on CPU.

``python -m tests.accumulator_worker <out_dir> <scenario>``; the rank writes ``<out_dir>/rank<r>.json``.

- ``sync``: an ``Accumulator`` with a state of each reduction, rank-dependent values, synced once with ``all_reduce``.
- ``fit``: a 6-step Trainer fit under DDP with ``GradientUnderflowMonitor`` and ``AmaxHistoryLogger`` logging every 3
  steps; every ``torch.distributed.all_reduce`` call is recorded with the step it ran in.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.distributed import finish


def counting_all_reduce(calls: list[Any], where: Any) -> None:
    """Record each ``torch.distributed.all_reduce`` call (``where()`` says when) before running it."""
    original = dist.all_reduce

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append([where(), sys._getframe(1).f_globals["__name__"]])  # and the module that called it
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counted  # type: ignore[assignment]


def run_sync(rank: int) -> dict:
    from lightning_precision._core.accumulator import Accumulator, all_reduce

    dist.init_process_group("gloo")
    calls: list[Any] = []
    counting_all_reduce(calls, lambda: "sync")
    acc = Accumulator()
    acc.add_state("count", torch.zeros(3, dtype=torch.int64), "sum")
    acc.add_state("hist", torch.zeros(2, 2, dtype=torch.int64), "sum")
    acc.add_state("power", torch.zeros((), dtype=torch.float64), "sum")
    acc.add_state("peak", torch.zeros(2), "max")
    acc.add_state("floor", torch.full((2,), float("inf")), "min")
    acc.add_state("mine", torch.zeros(()), "last")
    for step in range(3):  # updates are local: no collective
        acc.update("count", torch.tensor([1, rank, step]))
        acc.update("hist", torch.full((2, 2), rank + 1))
        acc.update("power", torch.tensor(0.5 * (rank + 1), dtype=torch.float64))
        acc.update("peak", torch.tensor([float(rank), float(step)]))
        acc.update("floor", torch.tensor([float(rank), 10.0 - step]))
        acc.update("mine", torch.tensor(float(rank)))
    updates_calls = len(calls)
    synced = acc.sync(all_reduce)
    return {"updates_calls": updates_calls, "sync_calls": len(calls),
            "synced": {k: v.tolist() for k, v in synced.items()},
            "local": {k: v.tolist() for k, v in acc.state_dict().items()}}


def run_fit(rank: int, world: int) -> dict:
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lightning_precision.callbacks import AmaxHistoryLogger, GradientUnderflowMonitor
    from tests.helpers import QuietNet, loader, make_data

    class Step(Callback):
        step = -1

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            Step.step = trainer.global_step

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            Step.step = -1  # "at the end of fit"

    calls: list[Any] = []
    counting_all_reduce(calls, lambda: Step.step)
    monitor = GradientUnderflowMonitor(formats=("fp16",), warn_threshold=1.0, top_k=0)
    amax = AmaxHistoryLogger(history_len=4, what_if=False)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_steps=6, log_every_n_steps=3,
                        callbacks=[Step(), monitor, amax], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(QuietNet(), loader(make_data(12)))
    return {"calls": calls, "logged": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "amax": amax.last_metrics, "histogram": monitor.histogram.tolist(),
            "amax_history": amax.chronological_history().tolist()}


def main() -> None:
    out_dir, scenario = Path(sys.argv[1]), sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result = run_sync(rank) if scenario == "sync" else run_fit(rank, world)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    finish()


if __name__ == "__main__":
    from tests.cuda_kernels import refusing_what_cuda_refuses

    with refusing_what_cuda_refuses():  # as in the test process: the AMP ops refuse what CUDA refuses
        main()
