"""Each measuring callback's cost per training step (issue 36): the aten ops and host reads it adds to an ordinary step
and to a measuring step, at 4 and 16 linear layers, beside its amortised time ratio on this machine.

Counts: a ``TorchDispatchMode`` (``DispatchCounter``) over each training step of a Trainer fit, minus the same step of
the same fit without the callback (on a GPU every aten op is at least one kernel launch, every host read a
synchronisation). They depend on the code, not on the machine's speed. Two columns of ops: ``cpu``, as a CPU runs it,
and ``gpu``, the policy an accelerator takes (``_launches.ops_are_cheap``: ``AmaxHistoryLogger`` takes the weights'
amaxes in one ``_foreach_norm`` there, and one ``aminmax`` each on a CPU, where the fused norm writes |w| first).

- AmaxHistoryLogger: ordinary = a step it does not log; measuring = a logging step (what-if included).
- GradientUnderflowMonitor: ordinary = a step it neither measures nor logs; measuring = a measuring step (under
  fp16, the probe backward too).
- MFUMonitor: ordinary = a step inside its window; measuring = the step that closes it (one synchronisation).
- FP8Guard (under FP8Precision, emulated on a CPU): ordinary = a step it does not measure; measuring = one it does.
- layers="auto": ordinary = a step after it decided, against the plan it chose given outright; measuring = a
  calibration batch.

Time: fits with and without the callback alternated, CPU time per step (``time.process_time``), amortised over the
cadence: ((C - 1) * median ordinary step + mean measuring step) / C, over the median step without (goal 1.03).

    python benchmarks/callback_cost.py [--part ops|time|all] [--layers 4,16] [--width 256] [--steps 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import MLP, StepTimer  # noqa: E402

import lightning_precision as lp  # noqa: E402
from lightning_precision._step_ops import StepOps  # noqa: E402
from lightning_precision.callbacks import (  # noqa: E402
    AmaxHistoryLogger,
    FP8Guard,
    GradientUnderflowMonitor,
    MFUMonitor,
)


def _fp8(**kw: Any) -> Any:
    return lp.FP8Precision(emulate=True, skip_small_layers=False, skip_first_last=False, **kw)


# name -> (plugin, the callback at a cadence, whether step i (0-based) is a measuring step at that cadence)
Case = tuple[Callable[[], Any], Callable[[int], Any], Callable[[int, int], bool]]


def _due(i: int, cadence: int) -> bool:
    return (i + 1) % cadence == 0


CASES: dict[str, Case] = {
    "AmaxHistoryLogger": (lp.BF16MixedPrecision, lambda c: AmaxHistoryLogger(log_every_n_steps=c), _due),
    "GradientUnderflowMonitor (bf16)": (lp.BF16MixedPrecision, lambda c: GradientUnderflowMonitor(log_every_n_steps=c),
                                        _due),
    "GradientUnderflowMonitor (fp16)": (lp.FP16MixedPrecision, lambda c: GradientUnderflowMonitor(log_every_n_steps=c),
                                        _due),
    "MFUMonitor": (lp.BF16MixedPrecision, lambda c: MFUMonitor(flops_per_batch=1e9, peak_tflops=1.0,
                                                                log_every_n_steps=c), _due),
    "FP8Guard": (_fp8, lambda c: FP8Guard(every_n_steps=c, plan_path=None), _due),
}


def _data(width: int, batch: int, steps: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g))
               for _ in range(steps)]
    return torch.utils.data.DataLoader(batches, batch_size=None)


def fit(plugin: Any, callbacks: list, layers: int, width: int, batch: int, steps: int, cadence: int,
        root: str) -> Any:
    module = MLP(dims=(width,) * layers + (10,))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=callbacks, logger=False,
                        plugins=[plugin], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=cadence, default_root_dir=root)
    trainer.fit(module, _data(width, batch, steps))
    return trainer


def _counts(plugin: Any, callbacks: list, layers: int, args: argparse.Namespace, steps: int) -> list[tuple[int, int]]:
    per_step = StepOps()
    fit(plugin, [*callbacks, per_step], layers, args.width, args.batch, steps, 4, args.root)
    return per_step.counts


def _added(alone: list[tuple[int, int]], beside: list[tuple[int, int]], i: int) -> tuple[int, int]:
    return beside[i][0] - alone[i][0], beside[i][1] - alone[i][1]


def ops_part(args: argparse.Namespace) -> None:
    from lightning_precision.callbacks import amax

    steps, cadence = 8, 4  # ordinary: step 5 (the first steps make plans and caches); measuring: step 7
    print("| callback | layers | ordinary step: ops cpu / gpu, reads | measuring step: ops cpu / gpu, reads |")
    print("|---|---|---|---|")
    for layers in args.layers:
        for name, (plugin, callback, _) in CASES.items():
            if name == "FP8Guard" and not _has_torchao():
                continue
            rows = {}
            for policy in ("cpu", "gpu"):
                amax.ops_are_cheap = (lambda device: True) if policy == "cpu" else (lambda device: False)
                alone = _counts(plugin(), [], layers, args, steps)
                beside = _counts(plugin(), [callback(cadence)], layers, args, steps)
                rows[policy] = (_added(alone, beside, 5), _added(alone, beside, 7))
            (o_cpu, m_cpu), (o_gpu, m_gpu) = rows["cpu"], rows["gpu"]
            print(f"| {name} | {layers} | {o_cpu[0]} / {o_gpu[0]}, {o_gpu[1]} | {m_cpu[0]} / {m_gpu[0]}, {m_gpu[1]} |")
        if _has_torchao():
            auto = _fp8(layers="auto", calibration_batches=2)
            chosen = _counts(auto, [], layers, args, steps)
            given = _counts(_fp8(layers=auto.plan_in_force()), [], layers, args, steps)
            print(f"| layers=\"auto\" | {layers} | {_added(given, chosen, 5)[0]}, {_added(given, chosen, 5)[1]} |"
                  f" {_added(given, chosen, 0)[0]}, {_added(given, chosen, 0)[1]} (a calibration batch) |")
    amax.ops_are_cheap = lambda device: device.type == "cpu"


def _has_torchao() -> bool:
    try:
        import torchao  # noqa: F401
    except ImportError:
        return False
    return True


def time_part(args: argparse.Namespace) -> None:
    cadence = args.cadence
    print(f"\nCPU time per step, {args.rounds} rounds of alternated fits of {args.steps} steps, cadence {cadence},"
          f" MLP width {args.width}, batch {args.batch}, {torch.get_num_threads()} threads")
    print("| callback | layers | step without (ms) | ordinary | measuring | amortised |")
    print("|---|---|---|---|---|---|")
    for layers in args.layers:
        for name, (plugin, callback, due) in CASES.items():
            if name == "FP8Guard" and not _has_torchao():
                continue
            without: list[float] = []
            ordinary: list[float] = []
            measuring: list[float] = []
            for _ in range(args.rounds):
                for with_it in (False, True):
                    timer = StepTimer(clock=time.process_time)
                    fit(plugin(), ([callback(cadence)] if with_it else []) + [timer], layers, args.width, args.batch,
                        args.steps, cadence, args.root)
                    for i, t in enumerate(timer.times):
                        if i < 5:
                            continue  # warm-up: plans, caches, the first allocations
                        if not with_it:
                            without.append(t)
                        else:
                            (measuring if due(i, cadence) else ordinary).append(t)
            base = statistics.median(without)
            ordinary_ratio = statistics.median(ordinary) / base
            measuring_ratio = statistics.mean(measuring) / base
            amortised = ((cadence - 1) * ordinary_ratio + measuring_ratio) / cadence
            print(f"| {name} | {layers} | {base * 1e3:.2f} | {ordinary_ratio:.3f} | {measuring_ratio:.2f} |"
                  f" {amortised:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("ops", "time", "all"), default="all")
    parser.add_argument("--layers", default="4,16", help="linear layers of the MLPs, comma-separated")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100, help="steps per timed fit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cadence", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--root", default=None, help="where fits write (FP8Guard's plan file); default a temp folder")
    args = parser.parse_args()
    args.layers = [int(n) for n in args.layers.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import logging
    import tempfile

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        args.root = args.root or tmp
        print(f"torch {torch.__version__}, lightning {L.__version__}")
        if args.part in ("ops", "all"):
            ops_part(args)
        if args.part in ("time", "all"):
            time_part(args)


if __name__ == "__main__":
    main()
