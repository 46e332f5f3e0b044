"""True precision (``BF16TruePrecision``, ``FP16TruePrecision``): memory, step time and training quality against
Lightning's ``bf16-mixed`` and ``bf16-true``.

    python benchmarks/true_precision.py --threads 1 [--part bytes|time|ops|pieces|quality|regression] [--device cpu]
        [--model distilbert|vit|mlp] [--rounds 8] [--steps 30] [--quality-steps 200] [--seeds 3] [--profile]
        [--fused] [--ops-layers 4,16,64]

Six parts (all by default):

``bytes``: on the DistilBERT recipe's model (its embedded tiny default: 2.07M parameters, 94% of them the 30522x64 word
embedding; batches of 32 x 48 tokens), for each plugin and its ``update``/``optimizer_states``, the bytes a parameter
holds once the optimizer has stepped (``lightning_precision._bytes.training_bytes``: weights + gradients + optimizer
states + what the plugin keeps in them, counted from the tensors), against Lightning's ``bf16-mixed`` (fp32 weights,
gradients and AdamW states: 16 B). And the transient memory of the optimizer step: torch's CPU allocator exposes no
peak, so each variant runs in a fresh process with glibc's mmap threshold fixed at 128 KiB
(``MALLOC_MMAP_THRESHOLD_``: every tensor over it is its own mapping, returned to the system when freed, so the
resident set follows the live tensors instead of malloc's reuse of freed heap), and the peak resident set is reset
(``/proc/self/clear_refs``) once the gradients exist (``on_before_optimizer_step`` of the third step) and read after
the step (``on_train_batch_end``): the rise is what the step allocated at its peak. Printed beside it: the fp32 bytes
the plugin's step widens at once, computed (its largest chunk: weight, gradient and each state in fp32).

``time``: training step time (forward, backward, optimizer step, from batch start to batch end) of our
``BF16TruePrecision()`` (and ``update="compensated"``) against Lightning's ``precision="bf16-true"`` on the same
model and batches: fits alternated in one process (the order rotated each round), the CPU time of the process
(``time.process_time``; the wall clock on a GPU), the first steps of each fit dropped, one median per fit; each round's
ratio (ours / Lightning) is one paired sample, printed as median [IQR]. ``--profile`` adds a ``torch.profiler`` table
of our step (the ops that take its time).

``ops``: what one training step (forward, backward, optimizer step; the fourth, once the states exist) dispatches,
counted with a ``TorchDispatchMode`` (``DispatchCounter``): aten ops (on a GPU each is at least one kernel launch) and
host reads (``.item()``, ``bool(tensor)``: on a GPU each waits for the device), for ours against Lightning's
``bf16-true`` and ``bf16-mixed`` and torchao's ``_AdamW(bf16_stochastic_round=True)`` under ``bf16-true`` (where it
runs: it compiles a step per parameter shape), with the bytes a parameter holds. On MLPs of ``--ops-layers`` layers of
64x64 (the number of parameters grows, what the step adds must not) and the ``--model``, with AdamW as torch runs it on
the device (a loop over the parameters on a CPU, ``foreach`` on a GPU) and with ``AdamW(foreach=True)``.

``pieces``: candidates for the step's costliest pieces, timed beside what it does (random bits, the finite check).

``quality``: the DistilBERT and ViT recipes (embedded defaults, ``--quality-steps`` steps, batch 32, AdamW, validation
on 8 batches at the end) under ``32-true``, Lightning's ``bf16-mixed`` (``--seeds`` seeds: the run-to-run spread),
Lightning's ``bf16-true`` and ours (``BF16TruePrecision()`` and ``FP16TruePrecision()``): validation loss and accuracy,
and the mean training loss of the last 20 steps.

``regression``: the measurement behind ``update="stochastic"`` as the default: a 64x64 linear regression whose
weights start near 1.0 (bf16's ulp there is 2**-7), AdamW lr=1e-4 (an update of about 1e-4 a step: under half an ulp),
300 full-batch steps; the final loss (the final weights evaluated in fp32) under fp32, Lightning's ``bf16-true`` and
``16-true``, and ours with each ``update``, with the bytes a parameter.
"""

from __future__ import annotations

import argparse
import copy
import functools
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch import nn
from torch.utils.data import DataLoader

from lightning_precision import BF16TruePrecision, FP16TruePrecision
from lightning_precision._bytes import training_bytes
from lightning_precision._upstream.torch import DispatchCounter

sys.path.insert(0, str(Path(__file__).parent))
from _common import MLP, WARMUP, StepTimer, process_bytes  # noqa: E402

# label -> plugin factory; Lightning's first (the baselines), then ours.
BYTES_VARIANTS: dict[str, Callable[[], Precision]] = {
    "Lightning bf16-mixed": lambda: MixedPrecision("bf16-mixed", "cpu"),
    "Lightning bf16-true (rounds to nearest: updates lost)": lambda: HalfPrecision("bf16-true"),
    **{
        f"BF16TruePrecision(update={u!r}, optimizer_states={s!r})": functools.partial(
            BF16TruePrecision, update=u, optimizer_states=s)
        for u in ("stochastic", "compensated") for s in ("weight", "float32", "8bit")
    },
    "BF16TruePrecision(), step_chunk=2**20": lambda: BF16TruePrecision(step_chunk=2**20),
    "BF16TruePrecision(), step_chunk=2**18": lambda: BF16TruePrecision(step_chunk=2**18),
    "FP16TruePrecision()": lambda: FP16TruePrecision(),
    "FP16TruePrecision(update='compensated')": lambda: FP16TruePrecision(update="compensated"),
}


def _trainer(plugin: Any, steps: int, device: str, callbacks: list[Callback], **kwargs: Any) -> L.Trainer:
    accelerator = "gpu" if device.startswith("cuda") else "cpu"
    if isinstance(plugin, str):
        kwargs["precision"] = plugin
    else:
        kwargs["plugins"] = [plugin]
    return L.Trainer(accelerator=accelerator, devices=1, max_steps=steps, callbacks=callbacks, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, **kwargs)


def _loader(batches: list[Any]) -> DataLoader:
    """The batches as they are, one a step."""
    return DataLoader(batches, batch_size=None)  # type: ignore[arg-type]  # a list is a map-style dataset


def _optimizer(model: L.LightningModule) -> torch.optim.Optimizer:
    optimizer = model.configure_optimizers()
    assert isinstance(optimizer, torch.optim.Optimizer), "the recipes configure one optimizer"
    return optimizer


def _name(model_name: str) -> str:
    return "MLP 5 x 1024" if model_name == "mlp" else f"{model_name} recipe (tiny)"


def _recipe_batches(n: int, recipe: str = "distilbert") -> tuple[L.LightningModule, list[Any]]:
    """The recipe's model (its embedded default) and its first ``n`` training batches."""
    from lightning_precision.cli.recipes import RECIPES

    L.seed_everything(0, verbose=False)
    return RECIPES[recipe].training_batches(n)


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


# --- bytes ------------------------------------------------------------------------------------------------------------


class StepMemory(Callback):
    """The rise of the peak resident set (CPU) or of the allocator's peak (GPU) over the optimizer step of step
    ``at``, from the moment its gradients exist to the end of the batch."""

    def __init__(self, at: int, device: str) -> None:
        self.at, self.device, self.rise = at, device, -1

    def on_before_optimizer_step(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != self.at:
            return
        if self.device == "cpu":
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the peak resident set back to the current one
            self.base = process_bytes("VmRSS:")
        else:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != self.at + 1:
            return
        if self.device == "cpu":
            self.rise = process_bytes("VmHWM:") - self.base
        else:
            torch.cuda.synchronize()
            self.rise = torch.cuda.max_memory_allocated() - self.base


def _widened_bytes(plugin: Any, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """What our step holds in fp32 at once: its largest chunk (parameters of ``step_chunk`` elements, one parameter
    at least), each element a weight, a gradient and every state of the optimizer in fp32."""
    chunk = getattr(plugin, "step_chunk", None)
    if chunk is None:
        return 0
    states = max((sum(1 for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0
                      and (str(k).startswith("lp.hi.") or not str(k).startswith("lp.")))
                  for s in optimizer.state.values()), default=0)  # fp32 states are kept as two halves: one each
    largest = size = 0
    for p in model.parameters():
        n = p.numel()
        size = n if size and size + n > chunk else size + n
        largest = max(largest, size)
    return largest * 4 * (2 + states)


def _mlp_batches(n: int) -> tuple[L.LightningModule, list[Any]]:
    """Five 1024x1024 layers and a head (4.2M parameters in six tensors, none over 1.05M) on random batches of 64."""
    g = torch.Generator().manual_seed(0)
    return MLP(1024), [(torch.randn(64, 1024, generator=g), torch.randint(0, 10, (64,), generator=g))
                       for _ in range(n)]


def _batches(n: int, model_name: str) -> tuple[L.LightningModule, list[Any]]:
    return _mlp_batches(n) if model_name == "mlp" else _recipe_batches(n, model_name)


def bytes_child(label: str, device: str, model_name: str) -> dict[str, Any]:
    model, batches = _batches(3, model_name)
    plugin = BYTES_VARIANTS[label]()
    memory = StepMemory(at=2, device=device)
    trainer = _trainer(plugin, 3, device, [memory], limit_val_batches=0)
    trainer.fit(model, _loader(batches))
    counted = training_bytes(model, trainer.optimizers)
    return {"parameters": counted.parameters, "weights": counted.weights, "gradients": counted.gradients,
            "states": counted.optimizer_states, "per_parameter": counted.per_parameter, "rise": memory.rise,
            "widened": _widened_bytes(plugin, model, trainer.optimizers[0])}


def run_bytes(args: argparse.Namespace) -> None:
    rows = {}
    for label in BYTES_VARIANTS:
        cmd = [sys.executable, __file__, "--_child", "bytes", "--_label", label, "--device", args.device,
               "--model", args.model,
               "--threads", str(args.threads)]
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        rows[label] = json.loads(out.splitlines()[-1])
    base = rows["Lightning bf16-mixed"]
    print(f"\n{_name(args.model)}, {base['parameters']:,} parameters, AdamW. Bytes a parameter after the optimizer"
          " has stepped; transient: rise of the peak resident set over one optimizer step (see the docstring)")
    print("| plugin | weights | gradients | optimizer states (+ plugin's) | B/param | x bf16-mixed |"
          " step transient (MiB) | widened at once, computed (MiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for label, r in rows.items():
        n = r["parameters"]
        widened = f"{r['widened'] / 2**20:.1f}" if r["widened"] else "-"
        print(f"| {label} | {r['weights'] / n:.2f} | {r['gradients'] / n:.2f} | {r['states'] / n:.2f} |"
              f" {r['per_parameter']:.2f} | {r['per_parameter'] / base['per_parameter']:.3f} |"
              f" {r['rise'] / 2**20:.1f} | {widened} |")


# --- time -------------------------------------------------------------------------------------------------------------

TIME_VARIANTS: dict[str, Callable[[], Any]] = {
    "Lightning bf16-true": lambda: "bf16-true",
    "Lightning bf16-mixed": lambda: "bf16-mixed",
    "BF16TruePrecision()": lambda: BF16TruePrecision(),
    "BF16TruePrecision(update='compensated')": lambda: BF16TruePrecision(update="compensated"),
    "Lightning 16-true (fp16 compute: slow on a CPU)": lambda: "16-true",
    "FP16TruePrecision()": lambda: FP16TruePrecision(),
}
# torchao's stochastically rounding AdamW (bf16 weights and states, its step compiled per parameter) under Lightning's
# bf16-true: the peer row, where torchao and a compiler are present.
TORCHAO_PEER = "torchao _AdamW(bf16_stochastic_round=True) under bf16-true"


def _clock(device: str) -> Callable[[], float]:
    if device == "cpu":
        return time.process_time

    def synchronized() -> float:
        torch.cuda.synchronize()
        return time.perf_counter()

    return synchronized


def _with_optimizer(model: L.LightningModule, kind: str | None) -> L.LightningModule:
    """``model`` stepping its own AdamW (``None``), or the same hyperparameters as ``"fused"``/``"foreach"`` AdamW or
    torchao's ``_AdamW(bf16_stochastic_round=True)`` (``"torchao"``)."""
    if kind is None:
        return model
    optimizer = _optimizer(model)
    if kind == "torchao":
        from torchao.optim import _AdamW

        keys = ("lr", "betas", "eps", "weight_decay", "amsgrad")
        replaced = _AdamW(model.parameters(), **{k: optimizer.defaults[k] for k in keys if k in optimizer.defaults},
                          bf16_stochastic_round=True)
    else:
        replaced = _fused(optimizer) if kind == "fused" else _foreach(optimizer)
    model.configure_optimizers = lambda: replaced  # type: ignore[method-assign]
    return model


def torchao_peer_reason(device: str, wanted: bool = True) -> str | None:
    """Why the torchao peer cannot run here (``None``: it runs): left out (``--no-peer``), torchao missing, or its
    compiled step failing (on a CPU it needs a C++ compiler)."""
    if not wanted:
        return "left out (--no-peer)"
    try:
        from torchao.optim import _AdamW

        weight = nn.Parameter(torch.ones(8, dtype=torch.bfloat16, device=device))
        weight.grad = torch.ones_like(weight)
        _AdamW([weight], bf16_stochastic_round=True).step()
    except Exception as error:  # noqa: BLE001  # any failure: the row says why instead of the run stopping
        return f"{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
    return None


def _fit_times(make: Callable[[], Any], batches: list[Any], args: argparse.Namespace,
               pristine: L.LightningModule, optimizer: str | None = None) -> list[float]:
    model = _with_optimizer(copy.deepcopy(pristine), optimizer or ("fused" if args.fused else None))
    timer = StepTimer(_clock(args.device))
    trainer = _trainer(make(), len(batches), args.device, [timer], limit_val_batches=0)
    trainer.fit(model, _loader(batches))
    return timer.times[WARMUP:]


def run_time(args: argparse.Namespace) -> None:
    model, batches = _batches(args.steps, args.model)
    variants: list[tuple[str, Callable[[], Any], str | None]] = [(label, make, None)
                                                                  for label, make in TIME_VARIANTS.items()]
    peer = torchao_peer_reason(args.device, not args.no_peer)
    if peer is None:
        variants.append((TORCHAO_PEER, lambda: "bf16-true", "torchao"))
    medians: dict[str, list[float]] = {label: [] for label, _, _ in variants}
    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for label, make, optimizer in order:
            medians[label].append(statistics.median(_fit_times(make, batches, args, model, optimizer)))
    reference = variants[0][0]
    print(f"\n{_name(args.model)}, AdamW{' (fused=True)' if args.fused else ''}: {args.rounds} rounds x"
          f" {args.steps} steps"
          f" (first {WARMUP} dropped), {'CPU time of the process' if args.device == 'cpu' else 'wall clock'}")
    print("| variant | ms/step (median of fits) | / Lightning bf16-true, paired median [IQR] |")
    print("|---|---|---|")
    for label, _, _ in variants:
        ratios = [a / b for a, b in zip(medians[label], medians[reference], strict=True)]
        lo, mid, hi = _quartiles(ratios)
        print(f"| {label} | {statistics.median(medians[label]) * 1e3:.2f} | {mid:.3f} [{lo:.3f}, {hi:.3f}] |")
    if peer is not None:
        print(f"| {TORCHAO_PEER} | not run: {peer} | |")
    if args.profile:
        profile_step(model, batches, args)


# --- ops ----------------------------------------------------------------------------------------------------------


class StepDispatches(Callback):
    """The aten ops and host reads of training step ``at`` (from batch start to batch end), counted."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.counter: DispatchCounter | None = None
        self.ops = self.reads = self.device_reads = -1

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            self.counter = DispatchCounter()
            self.counter.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
            self.ops, self.reads = len(self.counter.names), self.counter.host_reads
            self.device_reads = self.reads - self.counter.reads_on("cpu")
            self.counter = None


class DeepMLP(L.LightningModule):
    """``layers`` linear layers of 64x64 with ReLU between them (2 parameters a layer), AdamW."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(64, 64), nn.ReLU())])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


OPS_VARIANTS: dict[str, Callable[[], Any]] = {
    "Lightning bf16-true": lambda: "bf16-true",
    "Lightning bf16-mixed": lambda: "bf16-mixed",
    "BF16TruePrecision()": lambda: BF16TruePrecision(),
    "BF16TruePrecision(update='compensated')": lambda: BF16TruePrecision(update="compensated"),
    "BF16TruePrecision(update='nearest', optimizer_states='float32')": lambda: BF16TruePrecision(
        update="nearest", optimizer_states="float32"),
    "FP16TruePrecision()": lambda: FP16TruePrecision(),
    "FP16TruePrecision(update='compensated')": lambda: FP16TruePrecision(update="compensated"),
}


def _count_fit(make: Callable[[], Any], model: L.LightningModule, batches: list[Any], device: str,
               optimizer: str | None, count: bool = True) -> tuple[StepDispatches, float]:
    model = _with_optimizer(model, optimizer)
    counted = StepDispatches(at=3 if count else -1)
    run = _trainer(make(), 4, device, [counted], limit_val_batches=0)
    run.fit(model, _loader(batches[:4]))
    return counted, training_bytes(model, run.optimizers).per_parameter


def run_ops(args: argparse.Namespace) -> None:
    g = torch.Generator().manual_seed(0)
    models: list[tuple[str, Callable[[], tuple[L.LightningModule, list[Any]]]]] = [
        (f"MLP {n} x 64x64 ({2 * n} parameters)", functools.partial(
            lambda n: (DeepMLP(n), [(torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g))
                                    for _ in range(4)]), n))
        for n in (int(x) for x in args.ops_layers.split(","))
    ]
    models.append((_name(args.model), functools.partial(_batches, 4, args.model)))
    peer = torchao_peer_reason(args.device, not args.no_peer)
    for implementation in (None, "foreach"):
        how = ("AdamW as torch runs it here (" + ("foreach" if args.device != "cpu" else "a loop over the parameters")
               + ")") if implementation is None else "AdamW(foreach=True)"
        print(f"\nOne training step (the 4th), {how}: aten ops and host reads (all / of device tensors), and bytes a"
              " parameter")
        print("| model | variant | aten ops | / Lightning bf16-true | host reads (all / device) | B/param |")
        print("|---|---|---|---|---|---|")
        for name, build in models:
            rows = [(label, make, implementation) for label, make in OPS_VARIANTS.items()]
            reference = None
            for label, make, optimizer in rows:
                model, batches = build()
                counted, per_parameter = _count_fit(make, model, batches, args.device, optimizer)
                reference = reference or counted.ops
                print(f"| {name} | {label} | {counted.ops} | {counted.ops / reference:.2f} |"
                      f" {counted.reads} / {counted.device_reads} | {per_parameter:.2f} |")
            if implementation is None:
                model, batches = build()
                bytes_ = f"not run: {peer}" if peer is not None else \
                    f"{_count_fit(lambda: 'bf16-true', model, batches, args.device, 'torchao', count=False)[1]:.2f}"
                print(f"| {name} | {TORCHAO_PEER} | not counted: torch.compile refuses a TorchDispatchMode (a"
                      f" compiled step a parameter) | | | {bytes_} |")


def profile_step(pristine: L.LightningModule, batches: list[Any], args: argparse.Namespace) -> None:
    """The optimizer step alone, on the model's bf16 weights and the gradients of one backward: AdamW stepped on the
    bf16 weights (what Lightning's bf16-true does) against our step (``TrueStep``, the plugins' step) with each
    ``update``, alternated; then a ``torch.profiler`` table of ours (the default): the ops that take its time."""
    from torch.profiler import ProfilerActivity, profile

    from lightning_precision._core.true.precision import DEFAULT_STEP_CHUNK
    from lightning_precision._core.true.step import TrueStep

    base = copy.deepcopy(pristine).to(torch.bfloat16)
    batch = [t.to(torch.bfloat16) if t.is_floating_point() else t for t in batches[0]]
    loss_of: Any = getattr(base, "training_loss", None)  # the recipes' loss of a batch, without logging
    loss = loss_of(batch) if loss_of is not None else base.training_step(batch, 0)
    loss.backward()  # type: ignore[union-attr]

    def fresh() -> torch.optim.Optimizer:
        model = copy.deepcopy(base)
        for p, q in zip(model.parameters(), base.parameters(), strict=True):
            p.grad = None if q.grad is None else q.grad.clone()
        optimizer = _optimizer(model)
        return _fused(optimizer) if args.fused else optimizer

    def ours(update: str, chunk: int = DEFAULT_STEP_CHUNK) -> Callable[[torch.optim.Optimizer], Any]:
        stepper = TrueStep(torch.bfloat16, update, "weight", 0, chunk)
        return lambda optimizer: stepper.step(optimizer, None, None)

    steps: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
        "AdamW on the bf16 weights (Lightning bf16-true)": lambda optimizer: optimizer.step(),
        **{f"ours, update={u!r}": ours(u) for u in ("stochastic", "compensated", "nearest")},
        "ours, update='stochastic', step_chunk=2**20": ours("stochastic", 2**20),
    }
    clock = _clock(args.device)
    times: dict[str, list[float]] = {label: [] for label in steps}
    optimizers = {label: fresh() for label in steps}
    for r in range(args.rounds * 2 + 2):
        order = list(steps.items())
        for label, step in order if r % 2 == 0 else order[::-1]:  # alternated: none always first
            t0 = clock()
            step(optimizers[label])
            if r >= 2:  # the first two steps create the states
                times[label].append(clock() - t0)
    print(f"\noptimizer step alone (AdamW{', fused=True' if args.fused else ''}, stochastic/compensated/nearest with"
          " 16-bit states), ms, median [IQR]:")
    for label, values in times.items():
        lo, mid, hi = _quartiles(values)
        print(f"  {label:<56}{mid * 1e3:8.2f} [{lo * 1e3:.2f}, {hi * 1e3:.2f}]")
    optimizer = optimizers["ours, update='stochastic'"]
    step = steps["ours, update='stochastic'"]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step(optimizer)
    print("\nours (update='stochastic'), 5 optimizer steps: torch ops by self CPU time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=40))


def _fused(optimizer: torch.optim.Optimizer, flag: str = "fused") -> torch.optim.Optimizer:
    """The same optimizer class and hyperparameters, with its fused kernel (AdamW's ``fused=True``), or its foreach
    one (``flag="foreach"``)."""
    accepted = inspect.signature(type(optimizer)).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted and k not in ("foreach", "fused")}
    return type(optimizer)(optimizer.param_groups[0]["params"], **defaults, **{flag: True})  # type: ignore[arg-type]


def _foreach(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return _fused(optimizer, "foreach")


def run_pieces(args: argparse.Namespace) -> None:
    """What the step's most costly pieces would cost done otherwise (not what the plugins do: candidates), on 4.2M
    fp32 elements (the MLP's parameters), alternated, ms median: the rounding's random bits and the finite check."""
    n = 4_208_640
    generator = torch.Generator(device=args.device).manual_seed(0)
    new = torch.randn(n, device=args.device)
    old = new.clone()
    pieces: dict[str, Callable[[], Any]] = {
        "16-bit noise: randint, one an element (what the step draws, 3 an element with AdamW)": lambda: torch.randint(
            0, 2**16, (n,), dtype=torch.int32, device=args.device, generator=generator),
        "16-bit noise: 64-bit random_, viewed as four 16-bit": lambda: torch.empty(
            n // 4, dtype=torch.int64, device=args.device).random_(-(2**63), 2**63 - 1, generator=generator).view(
            torch.int16),
        "finite check: where(isfinite(new), new, old) (what the step does)": lambda: torch.where(
            torch.isfinite(new), new, old),
        "finite check: new.sum().isfinite(), read on the host": lambda: bool(new.sum().isfinite()),
    }
    clock = _clock(args.device)
    times: dict[str, list[float]] = {label: [] for label in pieces}
    for r in range(args.rounds * 2 + 1):
        order = list(pieces.items())
        for label, piece in order if r % 2 == 0 else order[::-1]:
            t0 = clock()
            piece()
            if r:
                times[label].append(clock() - t0)
    print(f"\npieces of the step on {n:,} fp32 elements, ms, median [IQR]:")
    for label, values in times.items():
        lo, mid, hi = _quartiles(values)
        print(f"  {label:<88}{mid * 1e3:8.2f} [{lo * 1e3:.2f}, {hi * 1e3:.2f}]")


# --- quality ----------------------------------------------------------------------------------------------------------


class LossTail(Callback):
    """Training loss of every step (read at the end: no host read during the fit)."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, *args: Any) -> None:
        self.losses.append(outputs["loss"].detach())


QUALITY_VARIANTS: dict[str, Callable[[], Any]] = {
    "32-true": lambda: "32-true",
    "Lightning bf16-mixed": lambda: "bf16-mixed",
    "Lightning bf16-true": lambda: "bf16-true",
    "BF16TruePrecision()": lambda: BF16TruePrecision(),
    "FP16TruePrecision()": lambda: FP16TruePrecision(),
}


def quality_run(recipe: str, label: str, seed: int, args: argparse.Namespace) -> dict[str, float]:
    from lightning_precision.cli.recipes import RECIPES

    L.seed_everything(seed, verbose=False)
    model, data = RECIPES[recipe].build()
    tail = LossTail()
    trainer = _trainer(QUALITY_VARIANTS[label](), args.quality_steps, args.device, [tail], limit_val_batches=8,
                       val_check_interval=args.quality_steps, check_val_every_n_epoch=None)
    trainer.fit(model, data)
    metrics = trainer.callback_metrics
    last = torch.stack([loss.float() for loss in tail.losses[-20:]]).mean()
    return {"train": float(last), "val_loss": float(metrics["val_loss"]), "val_acc": float(metrics["val_acc"])}


def run_quality(args: argparse.Namespace) -> None:
    for recipe in ("distilbert", "vit"):
        print(f"\n{recipe} recipe (embedded default), {args.quality_steps} steps, AdamW; validation on 8 batches")
        print("| precision | seed | train loss (last 20 steps) | val loss | val accuracy |")
        print("|---|---|---|---|---|")
        spread: dict[str, list[float]] = {"val_loss": [], "val_acc": []}
        for label in QUALITY_VARIANTS:
            seeds = range(args.seeds) if label == "Lightning bf16-mixed" else range(1)
            for seed in seeds:
                r = quality_run(recipe, label, seed, args)
                if label == "Lightning bf16-mixed":
                    spread["val_loss"].append(r["val_loss"])
                    spread["val_acc"].append(r["val_acc"])
                print(f"| {label} | {seed} | {r['train']:.4f} | {r['val_loss']:.4f} | {r['val_acc']:.4f} |",
                      flush=True)
        print(f"bf16-mixed spread over {args.seeds} seeds: val loss {min(spread['val_loss']):.4f} .."
              f" {max(spread['val_loss']):.4f}, val accuracy {min(spread['val_acc']):.4f} .."
              f" {max(spread['val_acc']):.4f}")


# --- regression -------------------------------------------------------------------------------------------------------


class Regression(L.LightningModule):
    """y = x W*^T with W* = 1 + N(0, 0.1^2); W starts at 1 + N(0, 0.01^2): every weight near 1.0."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.linear = nn.Linear(64, 64, bias=False)
        with torch.no_grad():
            self.linear.weight.copy_(1 + 0.01 * torch.randn(64, 64, generator=g))
        self.x = torch.randn(256, 64, generator=g)
        self.y = self.x @ (1 + 0.1 * torch.randn(64, 64, generator=g)).T

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.linear(x).float(), y.float())

    def loss_fp32(self) -> float:
        return float(nn.functional.mse_loss(self.x @ self.linear.weight.float().T, self.y))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


REGRESSION_VARIANTS: dict[str, Callable[[], Any]] = {
    "32-true": lambda: "32-true",
    "Lightning bf16-true": lambda: "bf16-true",
    "Lightning 16-true": lambda: "16-true",
    "BF16TruePrecision(update='stochastic') (default)": lambda: BF16TruePrecision(),
    "BF16TruePrecision(update='compensated')": lambda: BF16TruePrecision(update="compensated"),
    "BF16TruePrecision(update='nearest')": lambda: BF16TruePrecision(update="nearest"),
    "BF16TruePrecision(optimizer_states='float32')": lambda: BF16TruePrecision(optimizer_states="float32"),
    "FP16TruePrecision() (stochastic)": lambda: FP16TruePrecision(),
}


def run_regression(args: argparse.Namespace) -> None:
    print("\n64x64 linear regression, weights near 1.0, AdamW lr=1e-4, 300 full-batch steps (loss of the weights in"
          " fp32)")
    print("| precision | initial loss | final loss | B/param |")
    print("|---|---|---|---|")
    for label, make in REGRESSION_VARIANTS.items():
        model = Regression()
        initial = model.loss_fp32()
        batches = [(model.x, model.y)] * 300
        trainer = _trainer(make(), 300, args.device, [], limit_val_batches=0)
        trainer.fit(model, _loader(batches))
        bytes_ = training_bytes(model, trainer.optimizers).per_parameter
        print(f"| {label} | {initial:.4f} | {model.loss_fp32():.4f} | {bytes_:.1f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("bytes", "time", "ops", "pieces", "quality", "regression"), action="append")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--rounds", type=int, default=8, help="time: alternated rounds")
    parser.add_argument("--steps", type=int, default=30, help="time: steps a fit")
    parser.add_argument("--quality-steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=3, help="quality: seeds of bf16-mixed")
    parser.add_argument("--model", choices=("distilbert", "vit", "mlp"), default="distilbert",
                        help="time and bytes: the recipe's model, or an MLP of 4.2M parameters")
    parser.add_argument("--fused", action="store_true", help="time: AdamW(fused=True) in every variant")
    parser.add_argument("--profile", action="store_true", help="time: the optimizer step alone, and where it goes")
    parser.add_argument("--ops-layers", default="4,16,64", help="ops: layers of the MLPs counted, comma-separated")
    parser.add_argument("--no-peer", action="store_true", help="time and ops: leave torchao's _AdamW row out")
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    parser.add_argument("--_label", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    if args._child == "bytes":
        print(json.dumps(bytes_child(args._label, args.device, args.model)))
        return
    print(f"torch {torch.__version__}, lightning {L.__version__}, {args.device}, {torch.get_num_threads()} thread(s),"
          f" load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    parts = args.part or ["bytes", "regression", "time", "ops", "pieces", "quality"]
    for part in parts:
        run = {"bytes": run_bytes, "time": run_time, "ops": run_ops, "pieces": run_pieces, "quality": run_quality,
               "regression": run_regression}
        run[part](args)
    print(f"\nload average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
