"""torch.compile of an fp8 model: the graphs dynamo compiles under ``FP8Precision`` (Fabric and Trainer) against
torchao's own ``convert_to_float8_training`` + ``torch.compile`` of the same model (the same layers converted, the
same recipe, the same batches, bf16 autocast as the plugin runs it).

Counted per variant over ``--steps`` training steps: graphs compiled (dynamo's ``CompileCounterWithBackend`` around
the backend: one per frame compiled, first compiles and recompiles alike), recompiles with the guard that failed,
graph breaks, and the ops captured. The ratio printed is ours / torchao's graphs: the goal is 1.00. No time is
measured: how many graphs there are is decided by dynamo's guards, whatever the backend; ``--backend inductor`` (on
a GPU, or on a CPU with a C++ compiler) compiles them for real.

The model is a stack of ``--blocks`` pre-norm MLP blocks (LayerNorm, Linear width -> 4 width, GELU, Linear back,
residual). With ``--functional`` each block also holds an ``nn.Linear`` whose forward never runs (the block reads its
weight with ``F.linear``): both conversions convert it, and the plugin watches which layers ran and reports it as not
fp8 (one warning), the case the watch exists for.

    python benchmarks/compile_graphs.py [--device cpu|cuda] [--threads N] [--backend aot_eager|inductor|eager]
                                        [--recipe tensorwise|rowwise] [--blocks 4] [--width 256] [--steps 6]
                                        [--functional]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import warnings
from collections.abc import Callable
from typing import Any, cast

import lightning as L
import torch
import torch._dynamo
import torch._dynamo.testing
from torch import nn

from lightning_precision import FP8Precision
from lightning_precision.fabric import FP8Precision as FabricFP8Precision
from lightning_precision.fp8 import select_fp8_layers


class Block(nn.Module):
    def __init__(self, width: int, functional: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.gate = nn.Linear(width, width) if functional else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.gate is not None:  # its weight used directly: its forward never runs
            h = h * torch.sigmoid(nn.functional.linear(h, self.gate.weight.to(h.dtype)))
        return x + self.down(nn.functional.gelu(self.up(h)))


class Net(nn.Module):
    def __init__(self, blocks: int, width: int, functional: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(width, width)
        self.blocks = nn.Sequential(*(Block(width, functional) for _ in range(blocks)))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


class Recompiles(logging.Handler):
    """dynamo's ``recompiles`` log, kept: each record names the guard that failed."""

    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[str] = []
        self.logger = logging.getLogger("torch._dynamo.guards.__recompiles")

    def emit(self, record: logging.LogRecord) -> None:
        lines = record.getMessage().splitlines()
        self.reasons.append(next((ln.strip() for ln in lines if ln.strip().startswith("- ")), lines[0]))

    def __enter__(self) -> Recompiles:
        torch._logging.set_logs(recompiles=True)
        self.logger.addHandler(self)
        self.logger.propagate = False  # kept here, not printed as it comes
        return self

    def __exit__(self, *exc: Any) -> None:
        self.logger.removeHandler(self)
        self.logger.propagate = True
        torch._logging.set_logs()


def count(train: Callable[[Any], None], backend: str) -> dict[str, Any]:
    """Run ``train(compile_backend)`` and count what dynamo compiled."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    with Recompiles() as recompiles:
        # A function, not the counter: Fabric re-applies torch.compile with a deep copy of its arguments.
        train(lambda gm, inputs: counter(gm, inputs))
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    torch._dynamo.reset()
    return {"graphs": int(counter.frame_count), "recompiles": recompiles.reasons, "breaks": breaks,
            "ops": counter.op_count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--functional", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")  # the never-ran warning (--functional) is expected; the counts say the rest
    emulate = args.device != "cuda" or torch.cuda.get_device_capability() < (8, 9)
    kw: dict[str, Any] = {"recipe": args.recipe, "emulate": emulate, "skip_small_layers": False}
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(args.batch, args.width, generator=g) for _ in range(args.steps)]

    converted: list[int] = []  # layers in fp8 (torchao: converted; ours: counted, the never-ran ones not)

    def net() -> nn.Module:
        return Net(args.blocks, args.width, args.functional).to(args.device)

    def torchao(backend: Any) -> None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        model = net()
        # The same layers as the plugin's: its rules, with torchao's conversion.
        chosen = {d.fqn for d in select_fp8_layers(model, args.recipe, skip_small_layers=False) if d.fp8}
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(args.recipe), emulate=emulate)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn in chosen)
        converted.append(sum(type(m).__name__ == "Float8Linear" for m in model.modules()))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        compiled = torch.compile(model, backend=backend)
        for x in data:
            with torch.autocast(args.device, dtype=torch.bfloat16):
                loss = compiled(x.to(args.device)).float().square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    def fabric(backend: Any) -> None:
        plugin = FabricFP8Precision(**kw)
        f = L.Fabric(accelerator=args.device, devices=1, plugins=[plugin])
        model = net()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        # Fabric converts the module inside the compiled one, then compiles it again
        model, optimizer = f.setup(cast(nn.Module, torch.compile(model, backend=backend)), optimizer)
        for x in data:
            f.backward(model(x.to(args.device)).float().square().mean())
            optimizer.step()
            optimizer.zero_grad()
        converted.append(int(plugin.metrics()["precision/fp8_layers"].item()))

    class Lit(L.LightningModule):
        def __init__(self, backend: Any) -> None:
            super().__init__()
            self.net, self.backend = net(), backend

        def on_fit_start(self) -> None:
            self.net = cast(nn.Module, torch.compile(self.net, backend=self.backend))  # after the plugin converted it

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.net(batch).float().square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def trainer(backend: Any) -> None:
        plugin = FP8Precision(**kw)
        t = L.Trainer(accelerator=args.device, devices=1, max_steps=args.steps, plugins=[plugin],
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)
        t.fit(Lit(backend), torch.utils.data.DataLoader(cast(Any, data), batch_size=None))
        converted.append(int(plugin.metrics()["precision/fp8_layers"].item()))

    results = {name: count(run, args.backend) for name, run in
               (("torchao convert_to_float8_training", torchao), ("FP8Precision, Fabric", fabric),
                ("FP8Precision, Trainer", trainer))}
    peer = results["torchao convert_to_float8_training"]["graphs"]
    print(f"\ntorch {torch.__version__}, device {args.device}, backend {args.backend}, recipe {args.recipe},"
          f" {args.blocks} blocks of width {args.width}{' (+1 functional layer each)' if args.functional else ''},"
          f" {args.steps} steps, emulate={emulate}")
    print(f"{'variant':<36} {'graphs':>6} {'ratio':>6} {'recompiles':>10} {'breaks':>6} {'ops':>6}")
    for name, r in results.items():
        print(f"{name:<36} {r['graphs']:>6} {r['graphs'] / peer:>6.2f} {len(r['recompiles']):>10} {r['breaks']:>6}"
              f" {r['ops']:>6}")
    print(f"fp8 layers (torchao converted; Fabric, Trainer counted in fp8): {converted}")
    for name, r in results.items():
        for reason in r["recompiles"]:
            print(f"  {name}: recompiled: {reason}")


if __name__ == "__main__":
    main()
