"""Callbacks side by side on a ResNet18 CPU fit (fp32), alternating fits, median step times.

1. GradientUnderflowMonitor at the default cadence (log_every_n_steps=50) vs no callback: the monitor's cost sits on
   one step in 50, which a median hides and a mean over ~100 noisy steps cannot resolve, so its step time is
   amortised: (49 * median of ordinary steps + mean of measuring steps) / 50, against the median without it, and
   against its own ordinary steps (what the measuring adds, free of fit-to-fit noise). Goal ratio <= 1.03.
2. AmaxHistoryLogger: ``benchmarks/amax_cost.py`` and ``benchmarks/callback_cost.py`` (ops, reads and amortised time).
1b. GradientUnderflowMonitor at the default cadence on a small MLP (512 x4, then 10) under the bf16 and fp16 plugins
   (``--only monitor_mlp``): the monitor's own CPU time (its hooks: the fp16 probe backward, the measuring, ``compute``
   and the logging), summed over whole fits, against the rest of the step's CPU time: 1 + own / (step - own); and the
   same fits with and without it, alternated (CPU time per step, amortised as in 1). Goal ratio <= 1.03.
3. ChannelsLast callback vs converting by hand (model and each batch in the training step) vs contiguous:
   goal: the callback's speedup over contiguous >= 95% of the by-hand speedup.

    python benchmarks/callbacks_overhead.py [--rounds 3] [--steps 105] [--batch 16] [--size 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import MLP, WARMUP, ResNet18Module, StepTimer, image_data  # noqa: E402

from lightning_precision.callbacks import ChannelsLast, GradientUnderflowMonitor
from lightning_precision.functional import apply_channels_last, to_channels_last


class ByHand(ResNet18Module):
    """Channels-last the way people write it without the callback."""

    def __init__(self) -> None:
        super().__init__()
        apply_channels_last(self.net)

    def training_step(self, batch, batch_idx):
        return super().training_step(to_channels_last(batch), batch_idx)


CADENCE = 50


class TimedMonitor(GradientUnderflowMonitor):
    """Adds up the CPU time spent in the monitor's hooks (the probe backward runs inside ``on_before_backward``): the
    main thread's (``thread_time``, 0.6 us a call here; ``process_time`` costs 17 us, which would count as the
    monitor's; with one torch thread all of its work runs there)."""

    seconds = 0.0

    def __getattribute__(self, name):
        attr = super().__getattribute__(name)
        if name not in ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step"):
            return attr

        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return attr(*args, **kwargs)
            finally:
                TimedMonitor.seconds += time.thread_time() - start

        return timed


def monitor_mlp(rounds: int, steps: int, batch: int) -> None:
    """Row 1b: the monitor at its default cadence on a small MLP, under the bf16 and fp16 plugins."""
    from lightning_precision import BF16MixedPrecision, FP16MixedPrecision

    dims = (512,) * 5 + (10,)
    n = batch * steps
    mlp_data = torch.utils.data.TensorDataset(torch.randn(n, dims[0]), torch.randint(0, dims[-1], (n,)))
    for name, plugin in (("bf16", BF16MixedPrecision), ("fp16", FP16MixedPrecision)):
        own, total, pairs = [], [], []
        for r in range(rounds):
            runs = ["without", "with"] if r % 2 == 0 else ["with", "without"]
            step: dict[str, float] = {}
            for label in runs:
                TimedMonitor.seconds = 0.0
                times = fit(MLP(dims=dims), [TimedMonitor()] if label == "with" else [], steps, mlp_data,
                            keep_all=True, plugins=[plugin()], clock=time.process_time)
                if label == "with":
                    own.append(TimedMonitor.seconds)
                    total.append(sum(times))
                    step[label] = amortised([times])[0]
                else:
                    step[label] = statistics.median(times[WARMUP:])
            pairs.append(step["with"] / step["without"])
        own_ratio = statistics.median(1 + o / (t - o) for o, t in zip(own, total, strict=True))
        print(f"GradientUnderflowMonitor (MLP {'-'.join(map(str, dims))}, batch {batch}, {name} plugin, log every"
              f" {CADENCE}): its own CPU time {statistics.median(own) / steps * 1e3:.3f} ms per step = {own_ratio:.3f}"
              f" of the step without it; paired fits with / without (amortised CPU time per step): median"
              f" {statistics.median(pairs):.3f} over {len(pairs)} pairs (goal <= 1.03)")


def fit(module: L.LightningModule, callbacks: list, steps: int, data, log_every: int = CADENCE,
        keep_all: bool = False, plugins: list | None = None, clock=time.perf_counter) -> list[float]:
    timer = StepTimer(clock=clock)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, callbacks=[*callbacks, timer], logger=False, plugins=plugins,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=log_every,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=args.batch))
    return timer.times if keep_all else timer.times[WARMUP:]


def amortised(times_per_fit: list[list[float]]) -> tuple[float, float, float]:
    """(amortised step time, median ordinary step, mean measuring step) over fits whose steps i with (i+1) % CADENCE
    == 0 measured."""
    ordinary = [t for times in times_per_fit for i, t in enumerate(times) if i >= WARMUP and (i + 1) % CADENCE]
    measuring = [t for times in times_per_fit for i, t in enumerate(times) if (i + 1) % CADENCE == 0]
    base = statistics.median(ordinary)
    return (base * (CADENCE - 1) + statistics.mean(measuring)) / CADENCE, base, statistics.mean(measuring)


def compare(variants: dict, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():  # alternate so machine drift hits every variant alike
            times[name] += run()
    return {name: statistics.median(t) for name, t in times.items()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=105)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--only", choices=("monitor", "monitor_mlp", "channels_last", "sample"), default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    data = image_data(args.batch * args.steps, args.size)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, ResNet18 fp32, batch {args.batch}, "
          f"{args.size}x{args.size}, {args.rounds} rounds x {args.steps} steps (first {WARMUP} dropped)")

    if args.only in (None, "sample"):
        # The what-if statistics on 65,536 elements of an 8192x8192 weight (256 MB): an element-wise strided view
        # (before) against evenly spaced contiguous runs (now), same statistics. Strided, every element sits on its own
        # page.
        from lightning_precision.callbacks.amax import block_sample
        from lightning_precision.functional import multi_format_stats

        weight = torch.randn(8192, 8192)
        strided = weight.reshape(-1)[:: weight.numel() // 2**16]
        timings = {}
        for name, make in (("strided view", lambda: strided), ("contiguous runs", lambda: block_sample(weight, 2**16))):
            make_and_measure = lambda make=make: multi_format_stats(make(), ("e4m3fn",), torch.tensor(3.0))  # noqa: E731
            for _ in range(3):
                make_and_measure()
            start = time.perf_counter()
            for _ in range(20):
                make_and_measure()
            timings[name] = (time.perf_counter() - start) / 20
        print(f"what-if sample of 65,536 elements: strided view {timings['strided view'] * 1e3:.2f} ms, contiguous runs"
              f" {timings['contiguous runs'] * 1e3:.2f} ms per call"
              f" ({timings['strided view'] / timings['contiguous runs']:.0f}x)")
    if args.only in (None, "monitor_mlp"):
        monitor_mlp(args.rounds, args.steps, args.batch)
    if args.only in (None, "monitor"):
        none, with_monitor = [], []
        for _ in range(args.rounds):
            none += fit(ResNet18Module(), [], args.steps, data)
            with_monitor.append(fit(ResNet18Module(), [GradientUnderflowMonitor()], args.steps, data, keep_all=True))
        base = statistics.median(none)
        amort, ordinary, measuring = amortised(with_monitor)
        print(f"GradientUnderflowMonitor: without {base * 1e3:.1f} ms; with: ordinary steps {ordinary * 1e3:.1f} ms,"
              f" measuring steps {measuring * 1e3:.1f} ms, amortised {amort * 1e3:.1f} ms;"
              f" ratio {amort / base:.3f} against the fits without it, {amort / ordinary:.3f} against its own ordinary"
              " steps (the latter free of fit-to-fit noise; goal <= 1.03)")
    if args.only in ("monitor", "monitor_mlp", "sample"):
        sys.exit(0)

    c = compare({
        "contiguous": lambda: fit(ResNet18Module(), [], args.steps, data),
        "by hand": lambda: fit(ByHand(), [], args.steps, data),
        "callback": lambda: fit(ResNet18Module(), [ChannelsLast()], args.steps, data),
    }, args.rounds)
    hand, cb = c["contiguous"] / c["by hand"], c["contiguous"] / c["callback"]
    print(f"ChannelsLast: contiguous {c['contiguous'] * 1e3:.1f} ms, by hand {c['by hand'] * 1e3:.1f} ms "
          f"(speedup {hand:.3f}), callback {c['callback'] * 1e3:.1f} ms (speedup {cb:.3f}); "
          f"callback / by-hand speedup = {cb / hand:.3f} (goal >= 0.95)")
