"""Callbacks side by side on a ResNet18 CPU fit (fp32), alternating fits, median step times.

1. GradientUnderflowMonitor at the default cadence (log_every_n_steps=50) vs no callback: the monitor's cost sits on
   one step in 50, which a median hides and a mean over ~100 noisy steps cannot resolve, so its step time is
   amortised: (49 * median of ordinary steps + mean of measuring steps) / 50, against the median without it, and
   against its own ordinary steps (what the measuring adds, free of fit-to-fit noise). Goal ratio <= 1.03.
2. AmaxHistoryLogger (every step: amax hooks; logging steps: what-if casts) on a 5-layer MLP, same amortisation.
   Goal ratio <= 1.03.
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

from lightning_precision.callbacks import AmaxHistoryLogger, ChannelsLast, GradientUnderflowMonitor
from lightning_precision.functional import apply_channels_last, to_channels_last


class ByHand(ResNet18Module):
    """Channels-last the way people write it without the callback."""

    def __init__(self) -> None:
        super().__init__()
        apply_channels_last(self.net)

    def training_step(self, batch, batch_idx):
        return super().training_step(to_channels_last(batch), batch_idx)


CADENCE = 50


class TimedAmaxLogger(AmaxHistoryLogger):
    """Adds up the wall time spent in the logger's hooks and step."""

    seconds = 0.0

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                TimedAmaxLogger.seconds += time.perf_counter() - start

        return wrapper

    def _input_hook(self, i):
        return self._timed(super()._input_hook(i))

    def _output_hook(self, i):
        return self._timed(super()._output_hook(i))

    def _grad(self, i, g):
        return self._timed(super()._grad)(i, g)

    def on_before_optimizer_step(self, *args):
        return self._timed(super().on_before_optimizer_step)(*args)

    def on_train_batch_start(self, *args):
        return self._timed(super().on_train_batch_start)(*args)


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


class AlternatingAmaxLogger(AmaxHistoryLogger):
    """Measures on odd steps only (the logging steps, (step + 1) % 50 == 0, are odd); on even steps its hooks return at
    once. Comparing the two kinds of step inside one fit cancels the fit-to-fit drift of a shared machine (the baseline
    moved 12 -> 15 ms between runs here)."""

    active = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        AlternatingAmaxLogger.active = trainer.global_step % 2 == 1
        if self.active:
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def _input_hook(self, i):
        hook = super()._input_hook(i)
        return lambda *args: hook(*args) if AlternatingAmaxLogger.active else None

    def _output_hook(self, i):
        hook = super()._output_hook(i)
        return lambda *args: hook(*args) if AlternatingAmaxLogger.active else None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.active:
            super().on_before_optimizer_step(trainer, pl_module, optimizer)


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
    parser.add_argument("--width", type=int, default=2048, help="MLP width for the AmaxHistoryLogger run")
    parser.add_argument("--dims", default=None, help="MLP layer widths for the AmaxHistoryLogger run, e.g."
                        " 256,1024,1024,10 (instead of --width)")
    parser.add_argument("--only", choices=("monitor", "monitor_mlp", "channels_last", "amax", "sample"), default=None)
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
    if args.only in (None, "amax"):
        # Every step: hooks take the amax of each linear layer's input, weight and output gradient (on device);
        # on logging steps also the what-if casts. Same amortisation as the monitor.
        # On the MLP of plugin_overhead.py (5 linear layers): linear layers are all it has. --width 2048 is the
        # smallest square size torchao's tensorwise filter would run in fp8 (N > 1024).
        dims = tuple(int(d) for d in args.dims.split(",")) if args.dims else (args.width,) * 5 + (10,)
        shape = "-".join(map(str, dims))
        mlp_data = torch.utils.data.TensorDataset(torch.randn(args.batch * args.steps, dims[0]),
                                                  torch.randint(0, dims[-1], (args.batch * args.steps,)))
        none, with_logger = [], []
        for _ in range(args.rounds):
            none += fit(MLP(dims=dims), [], args.steps, mlp_data)
            with_logger.append(fit(MLP(dims=dims), [AmaxHistoryLogger()], args.steps, mlp_data, keep_all=True))
        base = statistics.median(none)
        amort, ordinary, measuring = amortised(with_logger)
        # Fit-to-fit noise on a shared 2-core machine reaches +-10% at this size, more than the effect: also time the
        # logger's own code inside the same fit (CPU ops are synchronous, so this is its real cost).
        timed = TimedAmaxLogger()
        steps_timed = fit(MLP(dims=dims), [timed], args.steps, mlp_data, keep_all=True)
        own = timed.seconds / len(steps_timed)
        step_time = statistics.mean(steps_timed) - own
        print(f"AmaxHistoryLogger (MLP {shape}, batch {args.batch}): its own code takes {own * 1e3:.2f} ms"
              f" per step on average (logging steps included) = {1 + own / step_time:.3f} of the step without it")
        print(f"AmaxHistoryLogger (MLP {shape}, batch {args.batch}): without {base * 1e3:.1f} ms; with: ordinary steps"
              f" {ordinary * 1e3:.1f} ms, logging steps {measuring * 1e3:.1f} ms, amortised {amort * 1e3:.1f} ms;"
              f" ratio {amort / base:.3f}"
              f" against the fits without it (goal <= 1.03)")
        # The same, measured inside one fit: odd steps with the logger, even steps without.
        alternating = AlternatingAmaxLogger(log_every_n_steps=CADENCE)
        on, off, logging = [], [], []
        for _ in range(args.rounds):
            for step, t in enumerate(fit(MLP(dims=dims), [alternating], args.steps * 2, mlp_data, keep_all=True)):
                if step < WARMUP:
                    continue
                if (step + 1) % CADENCE == 0:
                    logging.append(t)
                else:
                    (on if step % 2 == 1 else off).append(t)
        amort_ab = (statistics.median(on) * (CADENCE - 1) + statistics.mean(logging)) / CADENCE
        print(f"AmaxHistoryLogger (MLP {shape}, batch {args.batch}), A/B inside one fit: without"
              f" {statistics.median(off) * 1e3:.2f} ms, with {statistics.median(on) * 1e3:.2f} ms"
              f" (logging steps {statistics.mean(logging) * 1e3:.1f} ms),"
              f" amortised ratio {amort_ab / statistics.median(off):.3f} (goal <= 1.03)")
    if args.only in ("monitor", "monitor_mlp", "amax", "sample"):
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
