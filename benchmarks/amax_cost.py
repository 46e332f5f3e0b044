"""AmaxHistoryLogger's amortised cost: training steps of an MLP with and without the logger, side by side in one
process (alternated step by step, paired rounds, median and IQR), at the default cadence (one logging step with the
what-if in ``--cadence``), and against its limit: one read of the tensors it measures.

Three identical models (same seed, optimizer, data) step in turn: one bare, one with only the reads an exact amax
needs (``read_hooks``), one with the logger attached; each round is ``--steps`` such triples, so machine drift hits all
alike. The logger is driven the Fabric way (``capturing`` before the forward, ``end_step`` after the backward, the
logged values read to the host in one read as the Trainer callback does). Times are CPU time of this process
(``time.process_time``; on CUDA, wall time after a synchronize), which other processes on a shared machine disturb
less than wall time. Per round:

- ordinary: the median step with the logger over the median step without it;
- logging: the mean logging step over the median step without it;
- amortised: ``((cadence - 1) * ordinary + logging) / cadence`` (goal 1.03);
- read: the step with only the reads over the step without: the limit, what any exact amax of every input, weight
  and output gradient must at least cost (``torch.aminmax`` of each, in the same hooks, in the same step);
- cost / read: the logger's per-step cost (ordinary step with minus without) over the reads' (1: nothing but the
  reads).

    python benchmarks/amax_cost.py --threads 1                        # MLP 256-1024-1024-10
    python benchmarks/amax_cost.py --threads 1 --layers 16 --width 512
    python benchmarks/amax_cost.py --threads 1 --layers 64 --width 512 --block-formats ""   # no block what-if
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from lightning_precision.callbacks import AmaxHistoryLogger


def mlp(dims: tuple[int, ...], device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(len(dims) - 1):
        layers += [nn.Linear(dims[i], dims[i + 1])] + ([nn.GELU()] if i < len(dims) - 2 else [])
    return nn.Sequential(*layers).to(device)


class Clock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.process_time()


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def train_step(net, opt, data, clock, logger: AmaxHistoryLogger | None, log: bool) -> float:
    x, y = data
    t0 = clock()
    if logger is not None:
        logger.capturing(log)
    nn.functional.cross_entropy(net(x), y).backward()
    if logger is not None:
        metrics = logger.end_step(log)
        if log and metrics:
            torch.stack([v.float() for v in metrics.values()]).tolist()  # one device read, as the callback does
    opt.step()
    opt.zero_grad(set_to_none=True)
    return clock() - t0


def read_hooks(net: nn.Module) -> None:
    """The least an exact amax of every linear layer's input, weight and output gradient costs: one ``torch.aminmax``
    each, in the same hooks the logger uses, nothing kept. ``aminmax`` reads each element once and writes no
    temporary (``abs().amax()`` writes |x| first): the cheapest exact amax on a CPU."""
    def pre(module, args):
        torch.aminmax(args[0].detach()), torch.aminmax(module.weight.detach())

    def read(g):
        torch.aminmax(g)

    def post(module, args, out):
        out.register_hook(read)

    for m in net.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_pre_hook(pre)
            m.register_forward_hook(post)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="256,1024,1024,10", help="layer widths (ignored with --layers)")
    parser.add_argument("--layers", type=int, default=None, help="a deep MLP: this many linear layers of --width")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100, help="triples of steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cadence", type=int, default=50)
    parser.add_argument("--what-if-sample", default="65536", help="the logger's what_if_sample ('none': all)")
    parser.add_argument("--block-formats", default="mxfp8,nvfp4", help="the logger's block_formats ('' for none)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dims = (args.width,) * args.layers + (10,) if args.layers else tuple(int(d) for d in args.dims.split(","))
    plain, bare, net = mlp(dims, device), mlp(dims, device), mlp(dims, device)
    read_hooks(bare)
    plain_opt, bare_opt, opt = (torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (plain, bare, net))
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(args.batch, dims[0], generator=g).to(device),
            torch.randint(0, dims[-1], (args.batch,), generator=g).to(device))
    clock = Clock(device)
    sample = None if args.what_if_sample.lower() == "none" else int(args.what_if_sample)
    block_formats = tuple(f for f in args.block_formats.split(",") if f)
    logger = AmaxHistoryLogger(what_if_sample=sample, block_formats=block_formats)
    name = f"MLP {'-'.join(map(str, dims))}" if len(dims) <= 6 else f"MLP {len(dims) - 1} x {args.width}"
    print(f"{name}, batch {args.batch}, {device}, torch {torch.__version__}, {torch.get_num_threads()} threads;"
          f" {args.rounds} rounds x {args.steps} steps each way, cadence {args.cadence}")
    logger.attach(net)
    for s in range(10):  # warm-up, logging steps included
        train_step(plain, plain_opt, data, clock, None, False)
        train_step(bare, bare_opt, data, clock, None, False)
        train_step(net, opt, data, clock, logger, s % 2 == 1)
    rows: dict[str, list[float]] = {k: [] for k in ("without ms", "read", "ordinary", "logging", "amortised",
                                                     "cost us", "read us", "cost / read")}
    step = 0
    for _ in range(args.rounds):
        without: list[float] = []
        reads: list[float] = []
        ordinary: list[float] = []
        logging: list[float] = []
        for _ in range(args.steps):
            log = (step + 1) % args.cadence == 0
            without.append(train_step(plain, plain_opt, data, clock, None, False))
            reads.append(train_step(bare, bare_opt, data, clock, None, False))
            (logging if log else ordinary).append(train_step(net, opt, data, clock, logger, log))
            step += 1
        base, with_ = statistics.median(without), statistics.median(ordinary)
        log_step = statistics.mean(logging) if logging else with_
        read = statistics.median(reads) - base
        rows["without ms"].append(base * 1e3)
        rows["read"].append(statistics.median(reads) / base)
        rows["ordinary"].append(with_ / base)
        rows["logging"].append(log_step / base)
        rows["amortised"].append(((args.cadence - 1) * with_ + log_step) / args.cadence / base)
        rows["cost us"].append((with_ - base) * 1e6)
        rows["read us"].append(read * 1e6)
        rows["cost / read"].append((with_ - base) / read)
    for key, xs in rows.items():
        lo, mid, hi = quartiles(xs)
        print(f"  {key:12s} median {mid:9.3f}  IQR [{lo:.3f}, {hi:.3f}]")


if __name__ == "__main__":
    main()
