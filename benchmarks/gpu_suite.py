"""The GPU figures in one command: ResNet50, a DistilBERT-sized encoder and a ViT-L/16-sized block stack in 32-true,
16-mixed, bf16-mixed and fp8 (torchao tensorwise and rowwise through ``FP8Precision``), eager and compiled; the true
16-bit plugins against Lightning's ``bf16-true``; what GradientUnderflowMonitor and AmaxHistoryLogger cost on the GPU;
and the main job, ``lightning-precision compare --quick``, as a user first meets it there.

    python benchmarks/gpu_suite.py --out benchmarks/results --budget 420   # repo on PYTHONPATH or pip-installed
    benchmarks/gpu_run.sh                                                  # on a lent GPU: the cuda tier, then this

Each figure is a real ``lightning.Trainer`` fit: fixed shapes, random weights (seed 0), synthetic batches already on
the device, ``max_steps``, no logger, checkpoints or progress bar. A callback synchronises CUDA and reads the clock at
the end of every step, so a step is the interval between step ends (forward, backward, optimizer, every hook and the
loader); the first ``--warmup`` steps of a fit (``--compile-warmup`` when compiled: the first steps compile) are
dropped. Per run it reports the median ms/step, the speedup over the row's baseline (``vs``), MFU, peak allocated
memory (``torch.cuda.max_memory_allocated``, reset per fit), the bytes a trained parameter holds (weights, gradients,
optimizer states and what a plugin keeps beside them, ``_bytes.training_bytes``), and the aten ops of one warm-up step
of an eager fit (each at least one kernel launch: what makes a short step launch-bound). MFU divides the FLOPs of one
step (forward and backward, counted once per model and shape with ``lightning_precision._mfu.model_flops_per_step``)
by the dense peak that ``choose_peak`` gives for the device and the kind the plugin computes in (``peak_flops_dtype``;
fp32 without one), or by ``--peak-tflops`` (one number, or ``bf16=989,fp8=1979``). 32-true runs with torch's defaults
(fp32 matmuls, and TF32 cuDNN convolutions), counted against the fp32 peak: the header line records both settings.

Sections (``--only resnet50,encoder,true,vit,monitors,compare``; rows ``vs`` their baseline):
  resnet50  ResNet50 (torchvision's layout, ``_common.resnet50``), batch 128 of 224x224, SGD: 32-true, bf16-mixed,
            16-mixed, each with ``ChannelsLast()`` off and on; all vs 32-true (contiguous).
  encoder   DistilBERT-sized encoder (6 post-norm layers, d 768, 12 heads, ffn 3072, vocab 30522, ``--seq`` 128 or
            512), batch 64, AdamW: 32-true, 16-mixed, and bf16-mixed, fp8 tensorwise and rowwise each eager and
            compiled; all vs 32-true.
  true      the encoder with 16-bit weights, gradients and optimizer states: Lightning's ``precision="bf16-true"``,
            ``BF16TruePrecision()`` and ``FP16TruePrecision()``; ratio (ms over Lightning's) and bytes/param.
  vit       ViT-L/16-sized block stack (24 pre-norm layers, d 1024, 16 heads, mlp 4096, 197 tokens in, class-token
            head), batch 32, AdamW: bf16-mixed, fp8 tensorwise and rowwise, each eager and compiled; fp8 rows vs
            bf16-mixed of the same mode, compiled bf16-mixed vs eager. The batch must be a multiple of 16 for fp8
            (197 tokens: torch._scaled_mm needs the weight-gradient GEMM's inner dimension, batch x 197, divisible).
  monitors  GradientUnderflowMonitor on ResNet50 16-mixed (its costliest case: measuring steps also probe the fp16
            backward), AmaxHistoryLogger on the encoder in bf16-mixed, each fit alternated with the same fit
            without it (``--monitor-rounds``), measuring and logging every ``--monitor-every`` steps; ms/step is the
            mean over whole periods (the amortised cost, measuring steps included), and the ratio is with / without.
  compare   ``lightning-precision compare --quick`` in its own processes (report in ``--out``/compare): per precision
            its ms/step, speedup, spread, whether its steps were launch-bound, and its verdict.

The transformer layers are built from ``nn.Linear`` and ``scaled_dot_product_attention``: all four linear layers of a
block run as modules and can run in fp8 (``nn.MultiheadAttention`` calls its output projection functionally). fp8
rows put every linear layer with dims divisible by 16 in fp8 (``--fp8-layers all``); ``--fp8-layers default`` keeps
``FP8Precision``'s size thresholds and first/last rule, under which rowwise converts no layer of these models. The
JSON records the fp8 layer count of each row.

A fit that fails (out of memory, no fp8 hardware: compute capability < 8.9, torchao missing, a compile error) is a
failed row with its one-line reason, and the suite goes on; the exit status is 1 only when every row failed, 2 for
bad arguments. A progress line per fit goes to stderr; the tables go to stdout at the end, and ``gpu_suite.json`` and
``gpu_suite.md`` (a header line with the device and the torch/lightning/torchao versions, ready for
docs/benchmarks.md) into ``--out``, rewritten whole (atomically) after every row: a suite stopped mid-way leaves the
rows it reached.

The rows run headline first (``tier``): the encoder's eager 32-true/bf16-mixed/16-mixed, the true-precision rows, one
round of the monitors, compare, ResNet50's 32-true and channels-last half precisions (estimated 4 minutes on an H200,
CUDA's start included); then the compiled ViT pair (about 6 minutes more, mostly inductor); then the rest (28 fits and
compare in all: an estimated 20-30 minutes). ``--budget SECONDS`` ends inside that time: a row starts only if its
estimate (``estimate_s``, from the H200 run of ../shared/GPU.md, scaled by how the rows so far compared with theirs)
fits in what is left, and a row left out says so. ``--budget 420`` gives the headline rows on one GPU lent for 15
minutes (its start takes minutes); ``--only`` and smaller ``--steps`` shorten it too.

Goals, printed beside the figures and not asserted: bf16/16-mixed >= 2.3x over 32-true on ResNet50 and >= 3x on the
encoder (eager); fp8 >= 1.3x over bf16-mixed on the ViT-L stack, both compiled; each monitor <= 1.03x amortised;
BF16TruePrecision's step within 1.10x of Lightning's bf16-true.

``--smoke`` runs everything on the CPU in about half a minute on 2 cores, to check the suite itself: tiny shapes of
the same layouts, 3-4 steps, fp8 emulated (``emulate=True``), ``torch.compile(backend="eager")`` (inductor would take
minutes here), compare on a tiny ViT for 6 steps, no MFU (no CPU peaks) and no peak memory. Its figures say nothing
about any GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import itertools
import json
import logging
import math
import os
import signal
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_precision import (
    BF16MixedPrecision,
    BF16TruePrecision,
    FP8Precision,
    FP16MixedPrecision,
    FP16TruePrecision,
)
from lightning_precision._bytes import training_bytes
from lightning_precision._mfu import PeakChoice, choose_peak, compute_kind, model_flops_per_step, parse_peak_override
from lightning_precision._upstream.torch import DispatchCounter
from lightning_precision.callbacks import AmaxHistoryLogger, ChannelsLast, GradientUnderflowMonitor
from lightning_precision.fp8._hardware import FP8_MIN_CAPABILITY

sys.path.insert(0, str(Path(__file__).parent))
from _common import resnet50  # noqa: E402

SECTIONS = ("resnet50", "encoder", "true", "vit", "monitors", "compare")
HALF = ("bf16-mixed", "16-mixed")
FP8 = ("fp8-tensorwise", "fp8-rowwise")
TRUE = ("bf16-true", "16-true")  # BF16TruePrecision(), FP16TruePrecision()
LIGHTNING_TRUE = "lightning-bf16-true"  # Lightning's own precision="bf16-true": the speed floor of a 16-bit step
JSON_NAME, MD_NAME, COMPARE_DIR = "gpu_suite.json", "gpu_suite.md", "compare"


# ---- shapes and settings ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransformerShape:
    layers: int
    dim: int
    heads: int
    ffn: int
    tokens: int
    batch: int
    classes: int
    vocab: int | None = None  # token ids in (an embedding) when set; else the stack takes embeddings


@dataclass(frozen=True)
class Shapes:
    image_size: int
    image_batch: int
    resnet_width: int
    encoder: TransformerShape
    vit: TransformerShape


def full_shapes(args: argparse.Namespace) -> Shapes:
    return Shapes(224, args.batch_resnet50, 64,
                  TransformerShape(6, 768, 12, 3072, args.seq, args.batch_encoder, 2, vocab=30522),
                  TransformerShape(24, 1024, 16, 4096, 197, args.batch_vit, 1000))


# Same layouts, CPU-sized: ResNet50 keeps its bottlenecks at base width 8; the transformers keep 2 layers of d 64.
SMOKE_SHAPES = Shapes(32, 2, 8, TransformerShape(2, 64, 4, 256, 16, 2, 2, vocab=1024),
                      TransformerShape(2, 64, 4, 256, 17, 2, 10))


@dataclass(frozen=True)
class Settings:
    device: str  # "cuda" or "cpu"
    smoke: bool
    steps: int  # timed steps per fit
    warmup: int
    compile_warmup: int
    compile_backend: str
    emulate_fp8: bool
    fp8_all_layers: bool
    monitor_every: int
    monitor_periods: int
    monitor_rounds: int
    peak_overrides: dict[str, float]

    @property
    def device_name(self) -> str:
        return torch.cuda.get_device_name() if self.device == "cuda" else "cpu"


# ---- models ----------------------------------------------------------------------------------------------------------


class Block(nn.Module):
    """A transformer layer whose four linear layers all run as modules (fp8 can convert each). ``pre_norm``: ViT's
    layout; otherwise BERT's (post-norm)."""

    def __init__(self, dim: int, heads: int, ffn: int, pre_norm: bool) -> None:
        super().__init__()
        self.heads, self.pre_norm = heads, pre_norm
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, ffn), nn.Linear(ffn, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)

    def attention(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))

    def mlp(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))

    def forward(self, x: Tensor) -> Tensor:
        if self.pre_norm:
            x = x + self.attention(self.norm1(x))
            return x + self.mlp(self.norm2(x))
        x = self.norm1(x + self.attention(x))
        return self.norm2(x + self.mlp(x))


def blocks(s: TransformerShape, pre_norm: bool) -> nn.Sequential:
    return nn.Sequential(*(Block(s.dim, s.heads, s.ffn, pre_norm) for _ in range(s.layers)))


class Encoder(nn.Module):
    """DistilBERT-shaped sequence classifier: token and position embeddings, post-norm layers, first-token head."""

    def __init__(self, s: TransformerShape) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.dim)
        self.pos = nn.Parameter(torch.randn(1, s.tokens, s.dim) * 0.02)
        self.norm = nn.LayerNorm(s.dim)
        self.blocks = blocks(s, pre_norm=False)
        self.head = nn.Linear(s.dim, s.classes)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.blocks(self.norm(self.embed(ids) + self.pos))[:, 0])


class BlockStack(nn.Module):
    """ViT's encoder without the patch embedding: embedded tokens in, pre-norm layers, final norm, class-token head."""

    def __init__(self, s: TransformerShape) -> None:
        super().__init__()
        self.blocks = blocks(s, pre_norm=True)
        self.norm = nn.LayerNorm(s.dim)
        self.head = nn.Linear(s.dim, s.classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.blocks(x))[:, 0])


@dataclass(frozen=True)
class ModelSpec:
    title: str
    build: Callable[[Shapes], nn.Module]
    batch: Callable[[Shapes, torch.Generator], tuple[Tensor, Tensor]]
    optimizer: str  # "sgd" or "adamw"
    describe: Callable[[Shapes], str]


def _image_batch(s: Shapes, g: torch.Generator) -> tuple[Tensor, Tensor]:
    return (torch.randn(s.image_batch, 3, s.image_size, s.image_size, generator=g),
            torch.randint(0, 1000, (s.image_batch,), generator=g))


def _token_batch(s: Shapes, g: torch.Generator) -> tuple[Tensor, Tensor]:
    e = s.encoder
    return (torch.randint(0, e.vocab, (e.batch, e.tokens), generator=g),
            torch.randint(0, e.classes, (e.batch,), generator=g))


def _embedding_batch(s: Shapes, g: torch.Generator) -> tuple[Tensor, Tensor]:
    v = s.vit
    return torch.randn(v.batch, v.tokens, v.dim, generator=g), torch.randint(0, v.classes, (v.batch,), generator=g)


def _describe_transformer(s: TransformerShape) -> str:
    return f"{s.layers} layers, d {s.dim}, {s.heads} heads, ffn {s.ffn}, {s.tokens} tokens, batch {s.batch}"


MODELS: dict[str, ModelSpec] = {
    "resnet50": ModelSpec(
        "ResNet50", lambda s: resnet50(1000, s.resnet_width), _image_batch, "sgd",
        lambda s: f"base width {s.resnet_width}, batch {s.image_batch} of 3x{s.image_size}x{s.image_size}, SGD"),
    "encoder": ModelSpec(
        "DistilBERT-sized encoder", lambda s: Encoder(s.encoder), _token_batch, "adamw",
        lambda s: f"{_describe_transformer(s.encoder)}, vocab {s.encoder.vocab}, AdamW"),
    "vit": ModelSpec(
        "ViT-L/16-sized block stack", lambda s: BlockStack(s.vit), _embedding_batch, "adamw",
        lambda s: f"{_describe_transformer(s.vit)}, AdamW"),
}


class BenchModule(L.LightningModule):
    def __init__(self, net: nn.Module, optimizer: str) -> None:
        super().__init__()
        self.net, self.optimizer = net, optimizer

    def loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x).float(), y)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def build_module(model: str, shapes: Shapes) -> BenchModule:
    torch.manual_seed(0)  # the same random weights in every row
    spec = MODELS[model]
    return BenchModule(spec.build(shapes), spec.optimizer)


class BatchPool(torch.utils.data.Dataset):
    """``steps`` batches cycling over a few made once on the device: no host-to-device copy or collation per step."""

    def __init__(self, model: str, shapes: Shapes, device: str, steps: int, distinct: int = 2) -> None:
        g = torch.Generator().manual_seed(0)
        self.pool = [tuple(t.to(device) for t in MODELS[model].batch(shapes, g)) for _ in range(distinct)]
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> tuple[Tensor, ...]:
        return self.pool[i % len(self.pool)]


# ---- runs ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    section: str
    name: str  # unique within the section
    model: str
    precision: str  # "32-true", "bf16-mixed", "16-mixed", "fp8-tensorwise", "fp8-rowwise", TRUE, LIGHTNING_TRUE
    baseline: str  # the name of the row (same section) this one's speedup is against
    channels_last: bool = False
    compiled: bool = False
    callback: str | None = None  # "GradientUnderflowMonitor" or "AmaxHistoryLogger"


def _name(precision: str, channels_last: bool = False, compiled: bool = False) -> str:
    return precision + (" channels-last" if channels_last else "") + (" compiled" if compiled else "")


def plan(sections: Sequence[str], rounds: int) -> list[RunSpec]:
    """The fits, in the order they run (``tier``): the headline rows first, so that a budget that ends early still has
    them, then the rest, each tier in section order. A monitor pair is alternated ``rounds`` times (its fits pool into
    one row each)."""
    specs: list[RunSpec] = []
    if "resnet50" in sections:
        specs += [RunSpec("resnet50", _name(p, cl), "resnet50", p, "32-true", channels_last=cl)
                  for cl in (False, True) for p in ("32-true", *HALF)]
    if "encoder" in sections:
        specs += [RunSpec("encoder", _name(p), "encoder", p, "32-true") for p in ("32-true", "16-mixed")]
        specs += [RunSpec("encoder", _name(p, compiled=c), "encoder", p, "32-true", compiled=c)
                  for p in ("bf16-mixed", *FP8) for c in (False, True)]
    if "true" in sections:  # 16-bit weights, gradients and states: ours against Lightning's bf16-true
        specs += [RunSpec("true", p, "encoder", p, LIGHTNING_TRUE) for p in (LIGHTNING_TRUE, *TRUE)]
    if "vit" in sections:
        # fp8 against bf16-mixed compiled the same way; compiled bf16-mixed against eager.
        specs += [RunSpec("vit", _name(p, compiled=c), "vit", p, _name("bf16-mixed", compiled=c and p in FP8),
                          compiled=c) for p in ("bf16-mixed", *FP8) for c in (False, True)]
    if "monitors" in sections:
        pairs = [("resnet50", "16-mixed", "GradientUnderflowMonitor"), ("encoder", "bf16-mixed", "AmaxHistoryLogger")]
        for _ in range(rounds):  # alternated, so drift in the machine's state hits both alike
            for model, precision, callback in pairs:
                base = f"{model} {precision}"
                specs += [RunSpec("monitors", base, model, precision, base),
                          RunSpec("monitors", f"{base} + {callback}", model, precision, base, callback=callback)]
    if "compare" in sections:  # the main job on this GPU, in processes of its own
        specs.append(RunSpec("compare", COMPARE_NAME, "compare", "compare", COMPARE_NAME))
    first = [i == next(j for j, t in enumerate(specs) if t == spec) for i, spec in enumerate(specs)]
    return [spec for _, spec in sorted(enumerate(specs), key=lambda ix: (tier(ix[1], first[ix[0]]), ix[0]))]


COMPARE_NAME = "compare --quick"


def tier(spec: RunSpec, first_round: bool = True) -> int:
    """When a row runs: the headline rows first (tiers 0-4, about 4 minutes on an H200), in the order a short lease
    needs them: the encoder's eager 32-true, bf16-mixed and 16-mixed; the true-precision rows; one round of the
    monitors; compare; ResNet50's 32-true and channels-last half precisions. Then the compiled ViT's bf16 and tensorwise
    fp8 (the fp8 goal, minutes of compilation), then the rest."""
    if spec.section == "encoder" and not spec.compiled and spec.precision in ("32-true", *HALF):
        return 0
    if spec.section == "true":
        return 1
    if spec.section == "monitors":
        return 2 if first_round else 6
    if spec.section == "compare":
        return 3
    if spec.section == "resnet50" and (spec.precision == "32-true") != spec.channels_last:
        return 4
    if spec.section == "vit" and spec.compiled and spec.precision in ("bf16-mixed", "fp8-tensorwise"):
        return 5
    return 6


class StepClock(Callback):
    """The interval between consecutive step ends, the device synchronised before each reading: every step's whole
    cost (forward, backward, optimizer, all hooks, the loader), and nothing of the next step's. The aten ops of step
    ``count_step`` (a warm-up step; None: none counted, as for compiled fits, whose graphs run their ops inside) are
    counted (``DispatchCounter``): each is at least one kernel launch."""

    def __init__(self, device: str, count_step: int | None = None) -> None:
        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        self.marks: list[float] = []
        self.count_step = count_step
        self.ops_per_step: int | None = None
        self._counter: DispatchCounter | None = None

    def _mark(self) -> None:
        self.sync()
        self.marks.append(time.perf_counter())

    def on_train_start(self, *args: Any) -> None:
        self._mark()

    def on_train_batch_start(self, *args: Any) -> None:
        if len(self.marks) - 1 == self.count_step:
            self._counter = DispatchCounter()
            self._counter.__enter__()

    def on_train_batch_end(self, *args: Any) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self.ops_per_step, self._counter = len(self._counter.names), None
        self._mark()

    @property
    def times(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.marks)]


class Unavailable(RuntimeError):
    """A row that cannot run here (said before building anything)."""


def fp8_unavailable(settings: Settings) -> str | None:
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install torchao)"
    if settings.emulate_fp8:
        return None
    if settings.device != "cuda":
        return f"no fp8 hardware: fp8 GEMMs need a CUDA GPU, this run is on {settings.device}"
    capability = torch.cuda.get_device_capability()
    if capability < FP8_MIN_CAPABILITY:
        need = ".".join(map(str, FP8_MIN_CAPABILITY))
        found = ".".join(map(str, capability))
        return f"no fp8 hardware: needs compute capability >= {need}, {settings.device_name} has {found}"
    return None


def make_plugin(spec: RunSpec, settings: Settings) -> Any | None:
    """The row's plugin; None for Lightning's own precisions (``lightning_precision_of``)."""
    if spec.precision in ("32-true", LIGHTNING_TRUE):
        return None
    if spec.precision == "bf16-mixed":
        return BF16MixedPrecision()
    if spec.precision == "16-mixed":
        return FP16MixedPrecision()
    if spec.precision == "bf16-true":
        return BF16TruePrecision()
    if spec.precision == "16-true":
        return FP16TruePrecision()
    why = fp8_unavailable(settings)
    if why:
        raise Unavailable(why)
    keep_rules = not settings.fp8_all_layers
    return FP8Precision(recipe=spec.precision.removeprefix("fp8-"), emulate=settings.emulate_fp8,
                        skip_small_layers=keep_rules, skip_first_last=keep_rules)


def make_callbacks(spec: RunSpec, settings: Settings) -> list[Callback]:
    callbacks: list[Callback] = [ChannelsLast()] if spec.channels_last else []
    if spec.callback == "GradientUnderflowMonitor":
        callbacks.append(GradientUnderflowMonitor(log_every_n_steps=settings.monitor_every))
    elif spec.callback == "AmaxHistoryLogger":
        callbacks.append(AmaxHistoryLogger(log_every_n_steps=settings.monitor_every))
    return callbacks


def warmup_of(spec: RunSpec, settings: Settings) -> int:
    return settings.compile_warmup if spec.compiled else settings.warmup


def timed_steps(spec: RunSpec, settings: Settings) -> int:
    # Monitors: whole periods, so each fit's timed steps hold the same number of measuring steps.
    return settings.monitor_every * settings.monitor_periods if spec.section == "monitors" else settings.steps


@dataclass(frozen=True)
class Fit:
    """What one fit measured."""

    times: list[float]  # seconds per timed step
    wall_s: float
    peak_memory: int | None  # bytes
    peak: PeakChoice
    fp8_layers: int | None
    linear_layers: int
    bytes_per_param: float | None = None  # weights, gradients and optimizer states (what a plugin keeps beside them)
    ops_per_step: int | None = None  # aten ops of one warm-up step (eager fits)


def fit_once(spec: RunSpec, shapes: Shapes, settings: Settings) -> Fit:
    start = time.perf_counter()
    plugin = make_plugin(spec, settings)
    module = build_module(spec.model, shapes)
    linear_layers = sum(isinstance(m, nn.Linear) for m in module.modules())
    warmup, steps = warmup_of(spec, settings), timed_steps(spec, settings)
    clock = StepClock(settings.device, count_step=None if spec.compiled else warmup - 1)
    trainer = L.Trainer(
        accelerator=settings.device, devices=1, precision=None if plugin else lightning_precision_of(spec),
        plugins=[plugin] if plugin else None, max_steps=warmup + steps,
        callbacks=[*make_callbacks(spec, settings), clock], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=settings.monitor_every,
        benchmark=settings.device == "cuda",  # cuDNN picks its convolution algorithms during the warm-up
    )
    batches = BatchPool(spec.model, shapes, settings.device, warmup + steps)
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    if spec.compiled:
        torch.compiler.reset()  # each compiled fit starts clean (and never meets dynamo's recompile limit)
    if settings.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(torch.compile(module, backend=settings.compile_backend) if spec.compiled else module, loader)
    times = clock.times
    if len(times) != warmup + steps:
        raise RuntimeError(f"the fit stopped after {len(times)} of {warmup + steps} steps")
    precision = trainer.precision_plugin
    kind = compute_kind(getattr(precision, "peak_flops_dtype", None) or torch.float32)
    return Fit(
        times=times[warmup:],
        wall_s=time.perf_counter() - start,
        peak_memory=torch.cuda.max_memory_allocated() if settings.device == "cuda" else None,
        peak=choose_peak(settings.device_name if settings.device == "cuda" else "cpu", kind, settings.peak_overrides),
        fp8_layers=sum(d.fp8 for d in precision.layer_decisions) if isinstance(precision, FP8Precision) else None,
        linear_layers=linear_layers,
        bytes_per_param=training_bytes(trainer.lightning_module, trainer.optimizers).per_parameter,
        ops_per_step=clock.ops_per_step,
    )


def lightning_precision_of(spec: RunSpec) -> str:
    """Lightning's own precision string for a row without a plugin."""
    return "bf16-true" if spec.precision == LIGHTNING_TRUE else "32-true"


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    reason = f"{type(err).__name__}: {text[0]}" if text else type(err).__name__
    return reason if len(reason) <= 300 else reason[:297] + "..."


def release_memory(settings: Settings) -> None:
    gc.collect()
    if settings.device == "cuda":
        torch.cuda.empty_cache()


def count_flops(model: str, shapes: Shapes, settings: Settings) -> dict[str, Any]:
    """FLOPs of one training step, once per model and shape (in fp32: the count does not depend on the precision)."""
    try:
        module = build_module(model, shapes).to(settings.device)
        batch = tuple(t.to(settings.device) for t in MODELS[model].batch(shapes, torch.Generator().manual_seed(0)))
        return {"flops_per_step": model_flops_per_step(module, batch, lambda m, b: m.loss(b))}
    except Exception as err:  # MFU is then n/a; the timing rows still run
        return {"flops_per_step": None, "reason": one_line(err)}
    finally:
        release_memory(settings)


# ---- rows ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    section: str
    name: str
    model: str
    precision: str
    channels_last: bool
    compiled: bool
    callback: str | None
    baseline: str
    status: str  # "ok", "failed", or "skipped" (not run: the budget would have ended during it)
    reason: str | None = None  # why it failed or was skipped
    ms_per_step: float | None = None  # the median; the mean over whole periods for the monitors
    ms_stat: str = "median"
    ms_median: float | None = None
    ms_mean: float | None = None
    steps_timed: int = 0
    fits: int = 0
    wall_s: float = 0.0
    speedup: float | None = None  # baseline ms / this row's ms
    ratio: float | None = None  # this row's ms / baseline ms (the monitors' overhead)
    flops_per_step: int | None = None
    mfu: float | None = None  # a fraction of the peak
    mfu_note: str = ""  # the peak's source, or why MFU is n/a
    peak_kind: str | None = None
    peak_tflops: float | None = None
    peak_memory_mib: float | None = None
    memory_note: str = ""
    fp8_layers: int | None = None
    fp8_emulated: bool | None = None
    linear_layers: int | None = None
    bytes_per_param: float | None = None
    ops_per_step: int | None = None


def measured_row(spec: RunSpec, fits: list[Fit], flops: dict[str, Any], settings: Settings) -> Row:
    times = [t for fit in fits for t in fit.times]
    median, mean = statistics.median(times) * 1e3, statistics.mean(times) * 1e3
    ms, stat = (mean, "mean") if spec.section == "monitors" else (median, "median")
    peak, count = fits[0].peak, flops.get("flops_per_step")
    if peak.tflops is None:
        mfu, note = None, peak.source
    elif count is None:
        mfu, note = None, f"n/a: FLOPs not counted ({flops.get('reason')})"
    else:
        mfu, note = count / (ms / 1e3) / (peak.tflops * 1e12), peak.source
    memory = [f.peak_memory for f in fits if f.peak_memory is not None]
    fp8 = spec.precision in FP8
    return Row(
        **_identity(spec), status="ok", ms_per_step=ms, ms_stat=stat, ms_median=median, ms_mean=mean,
        steps_timed=len(times), fits=len(fits), wall_s=sum(f.wall_s for f in fits), flops_per_step=count, mfu=mfu,
        mfu_note=note, peak_kind=peak.kind, peak_tflops=peak.tflops,
        peak_memory_mib=max(memory) / 2**20 if memory else None,
        memory_note="" if memory else f"n/a on {settings.device}",
        fp8_layers=fits[0].fp8_layers, fp8_emulated=settings.emulate_fp8 if fp8 else None,
        linear_layers=fits[0].linear_layers, bytes_per_param=fits[0].bytes_per_param, ops_per_step=fits[0].ops_per_step,
    )


def _identity(spec: RunSpec) -> dict[str, Any]:
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}


def with_baselines(rows: list[Row]) -> list[Row]:
    """Speedup and ratio against each row's baseline, where both ran."""
    by_key = {(r.section, r.name): r for r in rows}
    out = []
    for row in rows:
        base = by_key.get((row.section, row.baseline))
        if row.ms_per_step and base is not None and base.ms_per_step:  # both measured (compare's row has none)
            row = dataclasses.replace(row, speedup=base.ms_per_step / row.ms_per_step,
                                      ratio=row.ms_per_step / base.ms_per_step)
        out.append(row)
    return out


# ---- goals -----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Goal:
    text: str
    section: str
    target: float
    at_least: bool  # True: speedup >= target; False: ratio <= target
    chooses: Callable[[Row], bool]  # the rows that can meet it (the best one counts)


GOALS = (
    Goal("ResNet50: bf16/16-mixed >= 2.3x over 32-true", "resnet50", 2.3, True, lambda r: r.precision in HALF),
    Goal("encoder: bf16/16-mixed >= 3x over 32-true (eager)", "encoder", 3.0, True,
         lambda r: r.precision in HALF and not r.compiled),
    Goal("ViT-L stack: fp8 >= 1.3x over bf16-mixed, both compiled", "vit", 1.3, True,
         lambda r: r.precision in FP8 and r.compiled),
    Goal("GradientUnderflowMonitor <= 1.03x amortised", "monitors", 1.03, False,
         lambda r: r.callback == "GradientUnderflowMonitor"),
    Goal("AmaxHistoryLogger <= 1.03x amortised", "monitors", 1.03, False, lambda r: r.callback == "AmaxHistoryLogger"),
    Goal("true: BF16TruePrecision's step <= 1.10x Lightning's bf16-true", "true", 1.10, False,
         lambda r: r.precision == "bf16-true"),
)


def judge(goal: Goal, rows: list[Row]) -> dict[str, Any]:
    candidates = [r for r in rows if r.section == goal.section and goal.chooses(r)]
    scored = [r for r in candidates if (r.speedup if goal.at_least else r.ratio) is not None]
    out: dict[str, Any] = {"goal": goal.text, "target": goal.target, "value": None, "row": None, "met": None}
    if not candidates:
        return {**out, "note": "not run"}
    if not scored:
        return {**out, "note": "n/a: its rows or their baselines failed"}
    value = (lambda r: r.speedup) if goal.at_least else (lambda r: r.ratio)
    best = max(scored, key=value) if goal.at_least else min(scored, key=value)
    met = value(best) >= goal.target if goal.at_least else value(best) <= goal.target
    return {**out, "value": value(best), "row": best.name, "met": met, "note": ""}


# ---- reports ---------------------------------------------------------------------------------------------------------


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def environment(settings: Settings, shapes: Shapes) -> dict[str, Any]:
    cuda = settings.device == "cuda"
    with warnings.catch_warnings():  # newer torch deprecates the allow_tf32 flags in favour of fp32_precision
        warnings.simplefilter("ignore")
        cudnn_tf32 = bool(torch.backends.cudnn.allow_tf32)
    return {
        "device": settings.device_name,
        "capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
        "cuda": torch.version.cuda if cuda else None,
        "torch": torch.__version__, "lightning": L.__version__, "torchao": _version("torchao"),
        "float32_matmul_precision": torch.get_float32_matmul_precision(), "cudnn_allow_tf32": cudnn_tf32,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "smoke": settings.smoke,
        "settings": {k: v for k, v in dataclasses.asdict(settings).items()},
        "shapes": dataclasses.asdict(shapes),
    }


def header(env: dict[str, Any]) -> str:
    s = env["settings"]
    device = env["device"]
    if env["capability"]:
        device += f" (compute capability {env['capability']}, CUDA {env['cuda']})"
    fp8 = "every linear layer with dims divisible by 16" if s["fp8_all_layers"] else "FP8Precision's defaults"
    line = (f"Device: {device}; torch {env['torch']}, lightning {env['lightning']}, torchao {env['torchao']};"
            f" {env['date']}. {s['steps']} timed steps per fit after {s['warmup']} warm-up steps"
            f" ({s['compile_warmup']} compiled, backend {s['compile_backend']}); fp32 matmul precision"
            f" {env['float32_matmul_precision']}, cuDNN TF32 {'on' if env['cudnn_allow_tf32'] else 'off'};"
            f" fp8 layers: {fp8}"
            f"{' (emulated)' if s['emulate_fp8'] else ''}.")
    if env.get("rows_done") is not None:
        done, planned = env["rows_done"], env["rows_planned"]
        budget = f" within a budget of {env['budget_s']:g} s" if env.get("budget_s") else ""
        line += (f" {done} of {planned} planned runs reached{budget} in {env['elapsed_s']:.0f} s"
                 + ("" if done == planned else " (the suite was still running: these are the rows so far)") + ".")
    if env["smoke"]:
        line += " **Smoke run** (CPU, tiny shapes): it checks the suite, its figures say nothing about any GPU."
    return line


def _fmt(value: float | None, pattern: str, missing: str = "n/a") -> str:
    return pattern.format(value) if value is not None else missing


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def section_table(section: str, rows: list[Row]) -> list[str]:
    ratio = section in ("monitors", "true")  # overheads: this row's time over its baseline's
    ms = "ms/step (mean, amortised)" if section == "monitors" else "ms/step"
    relative = "with / without" if section == "monitors" else "ratio" if ratio else "speedup"
    lines = [f"| run | {ms} | {relative} | vs | MFU | peak memory | bytes/param | ops/step | fp8 layers | notes |",
             "|" + "---|" * 10]
    for r in rows:
        fp8 = "" if r.fp8_layers is None else f"{r.fp8_layers}/{r.linear_layers}"
        fp8 += " (emulated)" if r.fp8_emulated else ""
        versus = _fmt(r.ratio, "{:.3f}", "-") if ratio else _fmt(r.speedup, "{:.2f}x", "-")
        note = "" if r.status == "ok" else (f"{r.status}: {r.reason}" if r.status == "failed" else r.reason or "")
        lines.append(
            f"| {r.name} | {_fmt(r.ms_per_step, '{:.2f}', '-')} | {versus}"
            f" | {r.baseline} | {_fmt(r.mfu and r.mfu * 100, '{:.1f}%')} | {_fmt(r.peak_memory_mib, '{:.0f} MiB')}"
            f" | {_fmt(r.bytes_per_param, '{:.1f}', '-')} | {_fmt(r.ops_per_step, '{:d}', '-')} | {fp8}"
            f" | {_cell(note)} |")
    notes = sorted({f"MFU {r.mfu_note}" if r.mfu is None else f"MFU against {r.peak_tflops:g} TFLOP/s: {r.mfu_note}"
                    for r in rows if r.status == "ok"})
    return lines + ([""] + [f"- {n}" for n in notes] if notes else [])


def goals_table(goals: list[dict[str, Any]]) -> list[str]:
    lines = ["| goal | measured | best row | met |", "|---|---|---|---|"]
    for g in goals:
        verdict = "n/a" if g["met"] is None else ("met" if g["met"] else "not met")
        lines.append(f"| {g['goal']} | {_fmt(g['value'], '{:.3f}', g['note'])} | {g['row'] or '-'} | {verdict} |")
    return lines


def compare_table(result: dict[str, Any] | None, row: Row) -> list[str]:
    """compare's own figures: per precision its ms/step, speedup over 32-true, spread, whether its steps were
    launch-bound (and its aten ops a step), MFU; then its verdict."""
    if result is None:
        return [f"{row.status}: {row.reason}" if row.reason else "not run"]
    lines = [f"Exit code {result['exit_code']}, {result['wall_s']:.0f} s, report in `{result['folder']}`.", "",
             "| precision | ms/step | speedup | spread | launch-bound | ops/step | MFU | notes |", "|" + "---|" * 8]
    for r in result["rows"]:
        spread = _fmt(r["spread"] and r["spread"] * 100, "{:.0f}%", "-")
        lines.append(
            f"| {r['precision']} | {_fmt(r['median_step_ms'], '{:.2f}', '-')} | {_fmt(r['speedup'], '{:.2f}x', '-')}"
            f" | {spread} | {'yes' if r['launch_bound'] else 'no' if r['launch_bound'] is False else '-'}"
            f" | {_fmt(r['ops_per_step'], '{:d}', '-')} | {_fmt(r['mfu'] and r['mfu'] * 100, '{:.2f}%')}"
            f" | {_cell(r['error'] or '')} |")
    return lines + ["", f"Verdict: {result['verdict']}"]


def markdown(env: dict[str, Any], shapes: Shapes, rows: list[Row], goals: list[dict[str, Any]],
             compare: dict[str, Any] | None = None) -> str:
    # Headings one level under the "## The GPU suite" section of docs/benchmarks.md, where these tables go.
    lines = [header(env), ""]
    for section in SECTIONS:
        section_rows = [r for r in rows if r.section == section]
        if not section_rows:
            continue
        if section == "compare":
            command = compare["command"] if compare else f"lightning-precision {COMPARE_NAME}"
            lines += [f"### compare: `{command}` on this device", "",
                      *compare_table(compare, section_rows[0]), ""]
            continue
        if section == "monitors":
            title = (f"monitors: callbacks' overhead (ResNet50 16-mixed, encoder bf16-mixed; measuring every"
                     f" {env['settings']['monitor_every']} steps)")
        elif section == "true":
            title = (f"true: 16-bit weights, gradients and optimizer states on the {MODELS['encoder'].title}"
                     f" ({MODELS['encoder'].describe(shapes)}): ours against Lightning's bf16-true")
        else:
            title = f"{section}: {MODELS[section].title} ({MODELS[section].describe(shapes)})"
        lines += [f"### {title}", "", *section_table(section, section_rows), ""]
    title = "Goals (not asserted" + ("; a smoke run's verdicts say nothing" if env["smoke"] else "") + ")"
    lines += [f"### {title}", "", *goals_table(goals), ""]
    return "\n".join(lines)


# ---- main ------------------------------------------------------------------------------------------------------------


def _sections(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown section(s) {', '.join(unknown) or text!r}: choose from"
                                         f" {', '.join(SECTIONS)}")
    return names


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: a number of seconds") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text}: a positive number of seconds")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: a positive number")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", type=_sections, default=SECTIONS, help=f"comma-separated: {', '.join(SECTIONS)}")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results", help="for the JSON and markdown")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, fp8 emulated, compile backend eager")
    parser.add_argument("--steps", type=_positive, help="timed steps per fit (default 50; smoke 2)")
    parser.add_argument("--warmup", type=_positive, help="steps dropped per eager fit (default 10; smoke 1)")
    parser.add_argument("--compile-warmup", type=_positive, help="steps dropped per compiled fit (default 20; smoke 2)")
    parser.add_argument("--compile-backend", help="torch.compile backend (default inductor; smoke eager)")
    parser.add_argument("--batch-resnet50", type=_positive, default=128)
    parser.add_argument("--batch-encoder", type=_positive, default=64)
    parser.add_argument("--seq", type=_positive, default=128, help="encoder sequence length (128 or 512)")
    parser.add_argument("--batch-vit", type=_positive, default=32, help="a multiple of 16 for the fp8 rows")
    parser.add_argument("--fp8-layers", choices=("all", "default"), default="all",
                        help="all: every linear layer with dims divisible by 16; default: FP8Precision's rules")
    parser.add_argument("--monitor-every", type=_positive, help="monitors measure every N steps (default 50; smoke 2)")
    parser.add_argument("--monitor-periods", type=_positive, help="timed periods per monitor fit (default 2; smoke 1)")
    parser.add_argument("--monitor-rounds", type=_positive, help="alternated fits per monitor row (default 2; smoke 1)")
    parser.add_argument("--peak-tflops", type=str, help="peak TFLOP/s for MFU: one number or kind=number pairs")
    parser.add_argument("--budget", type=_seconds, help="end inside this many seconds: the rows run headline first, and"
                                                        " a row that would not end in time is left out (default: all)")
    args = parser.parse_args(argv)
    if args.peak_tflops is not None:
        try:
            args.peak_overrides = parse_peak_override(args.peak_tflops)
        except ValueError as err:
            parser.error(str(err))
    else:
        args.peak_overrides = {}
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: this suite measures GPUs (use --smoke to check it on the CPU)")
    return args


def settings_of(args: argparse.Namespace) -> Settings:
    smoke = args.smoke

    def pick(value: Any, full: Any, tiny: Any) -> Any:
        return value if value is not None else (tiny if smoke else full)

    return Settings(
        device="cpu" if smoke else "cuda", smoke=smoke, steps=pick(args.steps, 50, 2), warmup=pick(args.warmup, 10, 1),
        compile_warmup=pick(args.compile_warmup, 20, 2),
        compile_backend=pick(args.compile_backend, "inductor", "eager"),
        emulate_fp8=smoke, fp8_all_layers=args.fp8_layers == "all", monitor_every=pick(args.monitor_every, 50, 2),
        monitor_periods=pick(args.monitor_periods, 2, 1), monitor_rounds=pick(args.monitor_rounds, 2, 1),
        peak_overrides=args.peak_overrides,
    )


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Lightning's per-fit banners and warnings (no workers, no validation loop) would bury the progress lines."""
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric", "lightning_precision")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.WARNING)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---- compare -------------------------------------------------------------------------------------------------------

# The smoke run's compare: the CPU, the tiny ViT recipe, a few steps (its figures, like the smoke's, say nothing).
SMOKE_COMPARE = ("--accelerator", "cpu", "--recipe", "vit", "--steps", "6", "--batch-size", "8", "--val-batches", "1",
                 "--precisions", "32-true,bf16-mixed")
COMPARE_KEYS = ("precision", "median_step_ms", "speedup", "speedup_resolved", "spread", "noisy", "launch_bound",
                "ops_per_step", "launch_us", "mfu", "emulated", "peak_memory_mb", "error")
COMPARE_GRACE_S = 30  # after SIGTERM, what compare has to write what its runs reached


def compare_argv(settings: Settings, folder: Path) -> list[str]:
    return [sys.executable, "-m", "lightning_precision.cli", "compare",
            *(SMOKE_COMPARE if settings.smoke else ("--quick",)), "--out", str(folder)]


def stop_group(process: subprocess.Popen) -> str:
    """SIGTERM to the process and everything it started (its own session), SIGKILL after ``COMPARE_GRACE_S`` or at
    once on a second Ctrl-C or SIGTERM during the wait: what it printed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        return process.communicate(timeout=COMPARE_GRACE_S)[0] or ""
    except subprocess.TimeoutExpired:
        pass
    except BaseException:  # impatient: kill it all now, then go on stopping
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        raise
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    return process.communicate()[0] or ""


def run_compare(settings: Settings, out: Path, timeout: float | None) -> dict[str, Any]:
    """``lightning-precision compare --quick`` on this device, as a user first meets the main job, in processes of its
    own (its report in ``out/compare``): its rows and verdict. Past ``timeout``, or when the suite itself is stopped, it
    gets SIGTERM (it then writes what its runs reached) and, after ``COMPARE_GRACE_S``, SIGKILL, with every process it
    started. A report is taken only if this run wrote it: one left by an earlier suite in the same ``--out`` is not."""
    folder = out / COMPARE_DIR
    report = folder / "report.json"
    before = report.stat().st_mtime_ns if report.exists() else None
    argv = compare_argv(settings, folder)
    start = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output = process.communicate(timeout=timeout)[0] or ""
    except subprocess.TimeoutExpired:
        output = stop_group(process)
    except BaseException:  # Ctrl-C, or SIGTERM (``main`` raises Stopped for it): compare goes with the suite
        stop_group(process)
        raise
    fresh = report.exists() and report.stat().st_mtime_ns != before
    if process.returncode not in (0, 1, 143) or not fresh:
        last = [line for line in output.splitlines() if line.strip()][-1:] or ["no output"]
        wrote = "" if fresh else " and wrote no report"
        raise RuntimeError(f"compare exited with {process.returncode}{wrote}: {last[0]}")
    data = json.loads(report.read_text())
    return {"exit_code": process.returncode, "wall_s": time.perf_counter() - start, "folder": str(folder),
            "command": " ".join(["lightning-precision", *argv[3:]]), "verdict": data["meta"]["verdict"],
            "rows": [{k: r.get(k) for k in COMPARE_KEYS} for r in data["results"]]}


# ---- the budget ------------------------------------------------------------------------------------------------------

# What a row takes on one H100/H200-class GPU, in seconds, from the H200 run of ../shared/GPU.md: Trainer setup and the
# model's move, its steps (the slowest eager precision of each model: 32-true, twice the others; FP16TruePrecision at
# 133 ms a step), compilation (1-2 min for the encoder, 2-4 for the 24-layer ViT stack), compare --quick (45 s there).
# Rough on purpose: `Budget` scales them by what the rows so far took. A smoke row takes seconds on 2 CPU cores.
SETUP_S = 8.0
STEP_MS = {"resnet50": 35.0, "encoder": 20.0, "vit": 30.0}
TRUE_STEP_MS = 140.0
COMPILE_S = {"encoder": 90.0, "vit": 180.0, "resnet50": 120.0}
COMPARE_S = 75.0
SMOKE_FIT_S, SMOKE_COMPARE_S = 3.0, 30.0


def estimate_s(spec: RunSpec, settings: Settings) -> float:
    """The seconds ``spec`` is expected to take (see ``SETUP_S``)."""
    if spec.section == "compare":
        return SMOKE_COMPARE_S if settings.smoke else COMPARE_S
    if settings.smoke:
        return SMOKE_FIT_S
    ms = TRUE_STEP_MS if spec.precision in TRUE else STEP_MS[spec.model] * (2 if spec.precision == "32-true" else 1)
    steps = warmup_of(spec, settings) + timed_steps(spec, settings)
    return SETUP_S + steps * ms / 1e3 + (COMPILE_S[spec.model] if spec.compiled else 0.0)


@dataclass
class Budget:
    """Plans the rows to end inside ``seconds`` (None: no limit): a row starts only if its estimate, scaled by how the
    rows so far compared with theirs (never below 1), fits in what is left. Rows run in ``plan``'s order, the headline
    ones first, so a short budget keeps them."""

    seconds: float | None
    start: float = dataclasses.field(default_factory=time.perf_counter)
    estimated: float = 0.0
    taken: float = 0.0

    def left(self) -> float:
        return math.inf if self.seconds is None else self.seconds - (time.perf_counter() - self.start)

    def scale(self) -> float:
        return max(1.0, self.taken / self.estimated) if self.estimated else 1.0

    def admits(self, estimate: float) -> bool:
        return estimate * self.scale() <= self.left()

    def record(self, estimate: float, taken: float) -> None:
        self.estimated += estimate
        self.taken += taken


# ---- running ---------------------------------------------------------------------------------------------------------


@dataclass
class Progress:
    """What the suite has measured so far, as rows at any moment (``rows``): written after every row."""

    specs: list[RunSpec]
    settings: Settings
    fits: dict[tuple[str, str], list[Fit]] = dataclasses.field(default_factory=dict)
    failures: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    skipped: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    flops: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    compare: dict[str, Any] | None = None

    def rows(self, done: int) -> list[Row]:
        """One row per spec of the first ``done``, in plan order."""
        rows = []
        for spec in dict.fromkeys(self.specs[:done]):
            key = (spec.section, spec.name)
            if key in self.fits:
                rows.append(measured_row(spec, self.fits[key], self.flops[spec.model], self.settings))
            elif key in self.failures:
                rows.append(Row(**_identity(spec), status="failed", reason=self.failures[key]))
            elif key in self.skipped:
                rows.append(Row(**_identity(spec), status="skipped", reason=self.skipped[key]))
            elif spec.section == "compare" and self.compare is not None:
                rows.append(Row(**_identity(spec), status="ok", wall_s=self.compare["wall_s"], fits=1))
        return with_baselines(rows)


def run(specs: list[RunSpec], shapes: Shapes, settings: Settings, budget: Budget | None = None,
        out: Path | None = None, written: Callable[[Progress, int], None] | None = None) -> Progress:
    """Every spec in order, within ``budget``; ``written(progress, done)`` after each one (the files, as they stand)."""
    budget = budget or Budget(None)
    state = Progress(specs, settings)
    for i, spec in enumerate(specs, 1):
        key = (spec.section, spec.name)
        progress(f"[gpu_suite {i}/{len(specs)}] {spec.section}: {spec.name}")
        if key in state.failures or key in state.skipped:  # a later round of a row that failed or was left out
            progress("    skipped: an earlier round " + ("failed" if key in state.failures else "was left out"))
            continue
        estimate = estimate_s(spec, settings)
        if not budget.admits(estimate):
            why = (f"not run: the budget ({budget.seconds:g} s) would end during it (about"
                   f" {estimate * budget.scale():.0f} s, {max(0.0, budget.left()):.1f} s left)")
            if key not in state.fits:  # a later round of a row that ran keeps that row's fits
                state.skipped[key] = why
            progress(f"    {why}")
            if written is not None:
                written(state, i)
            continue
        start = time.perf_counter()
        try:
            if spec.section == "compare":
                left = budget.left()
                state.compare = run_compare(settings, out or Path("."),
                                            timeout=max(1.0, left) if math.isfinite(left) else None)
                progress(f"    {state.compare['wall_s']:.0f} s, exit code {state.compare['exit_code']}")
            else:
                if spec.model not in state.flops:
                    state.flops[spec.model] = count_flops(spec.model, shapes, settings)
                fit = fit_once(spec, shapes, settings)
                state.fits.setdefault(key, []).append(fit)
                progress(f"    {statistics.median(fit.times) * 1e3:.2f} ms/step (median), {fit.wall_s:.0f} s")
        except Exception as err:  # OOM, no fp8 hardware, no torchao, compile errors: a failed row, the suite goes on
            state.failures[key] = one_line(err)
            progress(f"    failed: {state.failures[key]}")
        finally:
            budget.record(estimate, time.perf_counter() - start)
            if spec.compiled:
                torch.compiler.reset()
            release_memory(settings)
        if written is not None:
            written(state, i)
    return state


class Stopped(BaseException):
    """SIGTERM: raised where the suite is, so that it unwinds (compare stopped, nothing half written)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    raise Stopped(128 + signum)


def write_atomically(path: Path, text: str) -> None:
    """``path`` holds the old text or the new, whole, whatever stops the suite mid-write (a full disk included); two
    suites writing one folder each write a partial file of their own."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        partial.write_text(text)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    settings = settings_of(args)
    shapes = SMOKE_SHAPES if settings.smoke else full_shapes(args)
    budget = Budget(args.budget)
    specs = plan(args.only, settings.monitor_rounds)
    base_env = environment(settings, shapes)

    def render(state: Progress, done: int) -> tuple[str, str]:
        """The markdown and the JSON of the first ``done`` runs."""
        rows = state.rows(done)
        goals = [judge(g, rows) for g in GOALS if g.section in args.only]
        env = {**base_env, "elapsed_s": time.perf_counter() - budget.start, "budget_s": args.budget,
               "rows_done": done, "rows_planned": len(specs)}
        return markdown(env, shapes, rows, goals, state.compare), json.dumps(
            {"environment": env, "rows": [dataclasses.asdict(r) for r in rows], "goals": goals,
             "compare": state.compare}, indent=2, default=str)

    def write(state: Progress, done: int) -> None:
        text, data = render(state, done)
        write_atomically(args.out / JSON_NAME, data)
        write_atomically(args.out / MD_NAME, text)

    try:  # the files exist before any row: a folder that cannot be written fails now, not after the first fit
        args.out.mkdir(parents=True, exist_ok=True)
        write(Progress(specs, settings), 0)
    except OSError as err:
        print(f"gpu_suite: cannot write the results into {args.out}: {err}", file=sys.stderr)
        return 2
    unwritten: list[str] = []

    def write_as_it_goes(state: Progress, done: int) -> None:
        """A write that fails mid-run (a full disk) is said once and the suite goes on: the table still reaches
        stdout at the end, and the next row's write may succeed."""
        try:
            write(state, done)
        except OSError as err:
            if not unwritten:
                progress(f"[gpu_suite] cannot write the results into {args.out} ({err}): going on; the tables go to"
                         " stdout at the end")
            unwritten.append(str(err))

    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)  # unwinds: compare is stopped, the files stay whole
    try:
        with quiet():
            state = run(specs, shapes, settings, budget, args.out, write_as_it_goes)
    except (KeyboardInterrupt, Stopped) as stop:
        code = stop.code if isinstance(stop, Stopped) else 130
        progress(f"[gpu_suite] stopped ({'SIGTERM' if code == 143 else 'Ctrl-C'}): {args.out / JSON_NAME} and"
                 f" {args.out / MD_NAME} hold the rows reached")
        return code
    finally:
        signal.signal(signal.SIGTERM, previous)
    text, _ = render(state, len(specs))
    try:
        write(state, len(specs))
        where = f"wrote {args.out / JSON_NAME} and {args.out / MD_NAME}"
    except OSError as err:
        where = f"could not write the results into {args.out} ({err}): the tables above are all there is"
    print(text)
    rows = state.rows(len(specs))
    progress(f"[gpu_suite] {sum(r.status == 'ok' for r in rows)}/{len(rows)} rows ran in"
             f" {time.perf_counter() - budget.start:.0f} s; {where}")
    ok = any(r.status == "ok" for r in rows)
    return 0 if ok and where.startswith("wrote") else 1


if __name__ == "__main__":
    sys.exit(main())
