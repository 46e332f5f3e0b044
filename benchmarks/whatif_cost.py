"""What AmaxHistoryLogger's block-scaled what-if (``block_formats=("mxfp8", "nvfp4")``, on by default) adds to a
logging step, side by side in one run: the logger's ``end_step`` on the same captured step with and without it,
alternated, against an ordinary forward and backward of the model. It costs only on logging steps.

    python benchmarks/whatif_cost.py [--width 2048] [--layers 5] [--batch 16] [--reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from lightning_precision.callbacks import AmaxHistoryLogger


def logging_step_ms(net: nn.Module, logger: AmaxHistoryLogger, x: torch.Tensor) -> float:
    logger.capturing(True)
    net(x).sum().backward()
    start = time.perf_counter()
    metrics = logger.end_step(log=True)
    [float(v) for v in metrics.values()]  # read, as logging does
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    x = torch.randn(args.batch, args.width)
    loggers = {"without": AmaxHistoryLogger(block_formats=()), "with": AmaxHistoryLogger()}
    times: dict[str, list[float]] = {k: [] for k in loggers}
    for rep in range(args.reps + 2):  # the first two of each: warm-up
        for name, logger in loggers.items():  # alternated, so machine load hits both alike
            logger.attach(net)
            ms = logging_step_ms(net, logger, x)
            logger.detach()
            if rep >= 2:
                times[name].append(ms)
    steps = []
    for _ in range(args.reps):
        start = time.perf_counter()
        net(x).sum().backward()
        steps.append((time.perf_counter() - start) * 1e3)
    without, with_ = statistics.median(times["without"]), statistics.median(times["with"])
    step = statistics.median(steps)
    print(f"MLP {args.layers}x{args.width}, batch {args.batch}: end_step on a logging step {without:.1f} ms without the"
          f" block what-if, {with_:.1f} ms with it (+{with_ - without:.1f} ms = {(with_ - without) / step:.1%} of one"
          f" {step:.1f} ms forward+backward; amortised over 50 steps: {(with_ - without) / step / 50:.2%})")


if __name__ == "__main__":
    main()
