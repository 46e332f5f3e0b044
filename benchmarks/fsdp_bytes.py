"""FSDP2 bytes communicated per training step, and step time, under three precision set-ups.

FSDP2 (``fully_shard``) on CPU, gloo, 2 ranks, through Fabric's ``ModelParallelStrategy``; the same bias-free MLP
1024-4096-1024 (8.4M parameters), batch 32 per rank, SGD. Every ``nn.Linear`` is sharded, then the root.

- ``fp32``: ``BF16MixedPrecision``, sharded without a policy: parameters all-gathered in fp32.
- ``bf16 policy``: ``BF16MixedPrecision``, sharded with ``mp_policy=plugin.mp_policy`` (bf16 params, fp32 reduce).
- ``fp8 all-gather``: ``FP8Precision(emulate=True, fsdp_float8_all_gather=True)`` with ``plugin.mp_policy``.

Bytes: the ``torch.distributed`` collectives FSDP2 calls (``all_gather_single``, ``reduce_scatter_single`` in torch
2.13; the older ``*_tensor`` variants too) and all-reduces (fp8 weight amaxes) are wrapped and counted on rank 0 for
the 4th step (every later step must agree). An all-gather counts its output (the unsharded parameters each rank
receives), a reduce-scatter its input (the full gradient each rank contributes); each rank sends (world-1)/world of
either. Step time: rank 0's, forward to optimizer step, median of every step after the first 3 over all rounds (each a
fresh pair of ranks, configurations alternated).

    python benchmarks/fsdp_bytes.py [--rounds 3] [--steps 13] [--json PATH]

It starts its own ranks (it re-runs itself as one when RANK is set), each run bounded by 300 s, then killed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The ranks' launcher is the tests' (tests/distributed.py): one place starts and kills them.
sys.path.insert(0, str(ROOT))

from tests.distributed import finish, start_ranks  # noqa: E402

CONFIGS = ("fp32", "bf16 policy", "fp8 all-gather")
DIMS, BATCH, WORLD, WARMUP, TIMEOUT_S = (1024, 4096, 1024), 32, 2, 3, 300
# (module, function) -> (kind, the argument holding the full tensor: position, keyword). FSDP2 calls the first two
# (torch 2.13); DTensor reduces torchao's fp8 weight amaxes with the functional all_reduce.
COLLECTIVES = {
    ("torch.distributed", "all_gather_single"): ("all-gather", 0, "output_tensor"),
    ("torch.distributed", "reduce_scatter_single"): ("reduce-scatter", 1, "input"),
    ("torch.distributed", "all_gather_into_tensor"): ("all-gather", 0, "output_tensor"),
    ("torch.distributed", "reduce_scatter_tensor"): ("reduce-scatter", 1, "input"),
    ("torch.distributed", "all_reduce"): ("all-reduce", 0, "tensor"),
    ("torch.distributed._functional_collectives", "all_reduce"): ("all-reduce", 0, "self"),
}


def count_collectives(sink: list[dict[str, int]]) -> None:
    """Wrap the collectives where their callers look them up at call time (``dist.all_gather_single``, ...): add the
    bytes of each call's full tensor to ``sink[0]["<kind> <dtype>"]``. A call made inside another counts once."""
    import importlib

    depth = [0]

    def wrap(fn, kind: str, pos: int, key: str):
        def counted(*args, **kwargs):
            t = kwargs[key] if key in kwargs else args[pos]
            if not depth[0]:
                label = f"{kind} {str(t.dtype).replace('torch.', '')}"
                sink[0][label] = sink[0].get(label, 0) + t.numel() * t.element_size()
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return counted

    for (module_name, name), (kind, pos, key) in COLLECTIVES.items():
        module = importlib.import_module(module_name)
        if hasattr(module, name):
            setattr(module, name, wrap(getattr(module, name), kind, pos, key))


def run_rank(config: str, out_dir: Path, steps: int) -> None:
    import lightning as L
    import torch
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from lightning_precision.fabric import BF16MixedPrecision, FP8Precision

    warnings.filterwarnings("ignore")
    rank = int(os.environ["RANK"])
    if config == "fp8 all-gather":
        plugin = FP8Precision(emulate=True, skip_small_layers=False, skip_first_last=False, fsdp_float8_all_gather=True)
    else:
        plugin = BF16MixedPrecision()
    kw = {} if config == "fp32" else {"mp_policy": plugin.mp_policy}

    def parallelize(model: nn.Module, mesh) -> nn.Module:
        for layer in model.modules():
            if isinstance(layer, nn.Linear):  # torchao's Float8Linear too: Fabric converts before this runs
                fully_shard(layer, mesh=mesh["data_parallel"], **kw)
        fully_shard(model, mesh=mesh["data_parallel"], **kw)
        return model

    strategy = ModelParallelStrategy(parallelize, data_parallel_size=WORLD, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=strategy, plugins=[plugin])
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIMS[0], DIMS[1], bias=False), nn.ReLU(), nn.Linear(DIMS[1], DIMS[2], bias=False))
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(1 + rank)
    x, y = torch.randn(BATCH, DIMS[0], generator=g), torch.randint(0, DIMS[2], (BATCH,), generator=g)
    per_step, times, sink = [], [], [{}]
    count_collectives(sink)
    for _ in range(steps):
        sink[0] = {}
        per_step.append(sink[0])
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - t0)
    steady = per_step[WARMUP:]
    result = {"bytes": steady[0], "steady": all(s == steady[0] for s in steady), "first_step_bytes": per_step[0],
              "step_ms": [t * 1e3 for t in times[WARMUP:]],
              "layers": [type(m).__name__ for m in model.modules() if isinstance(m, nn.Linear)]}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    finish()


def launch(config: str, steps: int, out_dir: Path) -> dict:
    """Run ``config`` on WORLD ranks; return rank 0's result. Every rank is killed on a failure or after TIMEOUT_S."""
    argv = [str(Path(__file__).resolve()), "--config", config, "--out", str(out_dir), "--steps", str(steps)]
    failed = start_ranks(argv, out_dir, WORLD, TIMEOUT_S)
    if failed:
        sys.exit(f"{config}: {failed}")
    return json.loads((out_dir / "rank0.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=WARMUP + 10, help=f"steps per run; the first {WARMUP} untimed")
    parser.add_argument("--rounds", type=int, default=3, help="runs per configuration, alternated (times pooled)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--config", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must be more than the {WARMUP} warm-up steps")
    if "RANK" in os.environ:
        return run_rank(args.config, args.out, args.steps)

    from lightning_precision.cli.machine import describe, machine_info

    info = machine_info()
    machine = (f"{describe(info)}, lightning {info['packages']['lightning']}, torchao {info['packages']['torchao']};"
               f" {WORLD} ranks x 1 thread, gloo")
    runs: dict[str, list[dict]] = {config: [] for config in CONFIGS}
    for _ in range(args.rounds):  # alternate, so drift in the machine's load hits every configuration alike
        for config in CONFIGS:
            with tempfile.TemporaryDirectory() as tmp:
                runs[config].append(launch(config, args.steps, Path(tmp)))
    table = {config: summarize(rs, runs["fp32"][0]) for config, rs in runs.items()}
    print(f"Machine: {machine}")
    print(f"Model: bias-free MLP {'-'.join(map(str, DIMS))}, batch {BATCH} per rank, SGD; step {WARMUP + 1} counted,"
          f" median of {args.rounds} x {args.steps - WARMUP} steps timed (rank 0, runs alternated)\n")
    print("| configuration | all-gathered / step | ratio to fp32 | reduce-scattered / step | all-reduced / step"
          " | median step (ms) |\n|---|---|---|---|---|---|")
    for config, t in table.items():
        print(f"| {config} | {t['all-gather'] / 2**20:.2f} MiB ({t['all-gather dtype']}) | {t['ratio']:.3f} |"
              f" {t['reduce-scatter'] / 2**20:.2f} MiB ({t['reduce-scatter dtype']}) | {t['all-reduce']} B"
              f" ({t['all-reduce dtype']}) | {t['median step ms']:.1f} |")
        if not t["steady"]:
            print(f"  note: {config}: the counts differ between steps or rounds: {[r['bytes'] for r in runs[config]]}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "machine_info": info, "dims": DIMS, "batch": BATCH,
                                         "world": WORLD, "warmup": WARMUP, "table": table, "runs": runs}, indent=2))


def summarize(rs: list[dict], fp32: dict) -> dict:
    """Bytes and dtypes per kind of collective for the counted step, ratio of all-gathered bytes to fp32's, median."""
    out = {"steady": all(r["steady"] and r["bytes"] == rs[0]["bytes"] for r in rs)}
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        found = {label.split()[-1]: n for label, n in rs[0]["bytes"].items() if label.startswith(kind + " ")}
        out[kind], out[f"{kind} dtype"] = sum(found.values()), "+".join(sorted(found)) or "-"
    out["ratio"] = out["all-gather"] / sum(n for k, n in fp32["bytes"].items() if k.startswith("all-gather "))
    out["median step ms"] = statistics.median(t for r in rs for t in r["step_ms"])
    return out

if __name__ == "__main__":
    main()
