"""How large ``lightning-precision compare``'s workload is: on a CUDA GPU a recipe at its real dimensions
(DistilBERT-base, ViT-B/16, ResNet50 at 224x224), with the largest batch whose estimated memory fits a share of the
device beside the other precisions' processes; on a CPU the embedded default, as always. A pure choice from given facts
(the device's memory, the recipe's footprint, the options), so every case is tested without a GPU; ``main`` gathers
the facts and says the choice in the report.

Why an estimate and not a measured step: each precision runs in its own process, all of them holding the GPU's memory
side by side, so the batch must be known before any of them starts, and a step measured in the command's own process
would hold its memory through the comparison. The estimate is what the recipe's ``RealSize`` states: the bytes autograd
saves per sample in an fp32 step (32-true's, the largest of the rows; counted on the meta device, unfused attention:
more than a GPU's fused attention saves) plus what training holds per parameter and a process's CUDA context."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from lightning_precision.cli.recipes import RealSize

__all__ = ["CONTEXT_BYTES", "EMBEDDED_BATCH", "FILL", "MAX_BATCH", "MULTIPLE", "REAL_CPU_BATCH", "SIZES", "STATE_BYTES",
           "Gpu", "Workload", "choose_workload", "process_bytes"]

SIZES = ("auto", "embedded", "real")
GIB = 2**30
EMBEDDED_BATCH = 32  # the embedded default's batch, as it always was
# The share of the GPU's free memory the precisions' processes may fill together: the rest is for what the estimate
# leaves out (the allocator's fragmentation and caches, cuBLAS/cuDNN workspaces, torch.compile's buffers).
FILL = 0.7
CONTEXT_BYTES = 1 * GIB  # a process's CUDA context and libraries' handles, outside the allocator (0.5-1 GiB)
# Training's bytes per parameter beside the activations: fp32 weights 4, gradients 4, AdamW's two states 8, and the
# 16-bit copies of the weights that autocast keeps during a step 2.
STATE_BYTES = 18
MULTIPLE = 8  # batches are multiples of 8 (tensor cores' and fp8 matmuls' tiles divide them); also the least batch
# The largest batch sizing chooses: beyond it a recipe's matmuls fill any GPU (256 samples are 32k tokens of
# DistilBERT-base, 50k of ViT-B/16), and a larger batch only makes every step, and the comparison, longer.
MAX_BATCH = 256
REAL_CPU_BATCH = 8  # --size real on a CPU without --batch-size: the least batch (a ViT-B/16 step takes seconds there)


@dataclass(frozen=True)
class Gpu:
    """The CUDA device the precisions will run on, as ``torch.cuda`` reports it before any of them starts."""

    name: str
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class Workload:
    """The size that runs, its batch, and why, in the words the report prints after ``workload:``; ``warning``: what
    to tell the user before the runs start (a slow choice, a batch that may not fit)."""

    size: Literal["embedded", "real"]
    batch_size: int
    why: str
    warning: str | None = None

    @property
    def line(self) -> str:
        return f"workload: {self.why}"


def process_bytes(footprint: RealSize, batch: int) -> int:
    """The estimated memory of one precision's process training a recipe's real dimensions at ``batch``."""
    return CONTEXT_BYTES + STATE_BYTES * footprint.parameters + batch * footprint.activation_bytes


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}" if n < 10 * GIB else f"{n / GIB:.0f}"


def _fitted_batch(footprint: RealSize, gpu: Gpu, processes: int) -> tuple[int, int]:
    """The largest multiple of ``MULTIPLE`` (at most ``MAX_BATCH``) whose processes fit ``FILL`` of the free memory
    side by side (0 if not even ``MULTIPLE`` does), and the bytes each process may take."""
    share = int(FILL * gpu.free_bytes / processes)
    room = share - process_bytes(footprint, 0)
    fitted = max(0, room) // footprint.activation_bytes // MULTIPLE * MULTIPLE
    return min(MAX_BATCH, fitted), share


def _together(processes: int) -> str:
    """How many processes share the memory, where more than one does."""
    return "" if processes == 1 else f", {processes} side by side"


def _of_free(gpu: Gpu) -> str:
    """Which memory a share is of: the free memory the fit rests on, beside the device's total."""
    return f"the {_gib(gpu.free_bytes)} GiB free of the {_gib(gpu.total_bytes)} GiB of {gpu.name}"


def choose_workload(size: str, footprint: RealSize | None, gpu: Gpu | None, batch_size: int | None,
                    processes: int, no_gpu: str = "no CUDA GPU") -> Workload:
    """The workload of one comparison. ``size``: ``--size`` (auto, embedded, real); ``footprint``: the recipe's real
    dimensions and what they hold (``recipes.RealSize``; None: it has none); ``gpu``: the CUDA device the runs use,
    None where they run on a CPU (``no_gpu`` says why, for the report); ``batch_size``: ``--batch-size`` if given,
    which always wins; ``processes``: the precisions that run side by side. A ``ValueError`` naming the option and
    the fix where ``--size real`` cannot run: no real dimensions, or a GPU too small for the least batch (``auto``
    falls back to the embedded default there, and says why)."""
    if size not in SIZES:
        raise ValueError(f"--size {size!r}: use one of {', '.join(SIZES)}.")
    if processes < 1:
        raise ValueError(f"choose_workload(processes={processes}): at least one precision runs.")
    if batch_size is not None and batch_size < 1:  # 0 would silently stand for "not given"
        raise ValueError(f"choose_workload(batch_size={batch_size}): a batch holds at least 1 sample (--batch-size);"
                         " pass None to let the size choose it.")
    embedded_batch = batch_size or EMBEDDED_BATCH
    if size == "embedded":
        where = "CPU " if gpu is None else ""  # the default made for a CPU; said so only where it runs on one
        return Workload("embedded", embedded_batch, f"embedded {where}default (--size embedded)")
    if footprint is None:
        if size == "real":
            raise ValueError("--size real: this recipe has no real dimensions; use --size embedded.")
        return Workload("embedded", embedded_batch, "embedded default (the recipe has no real dimensions)")
    if gpu is None:
        if size == "auto":
            return Workload("embedded", embedded_batch, f"embedded CPU default ({no_gpu})")
        batch = batch_size or REAL_CPU_BATCH
        return Workload("real", batch, f"real dimensions ({footprint.name}, batch {batch}: --size real, {no_gpu})",
                        warning=f"--size real on a CPU: a step of {footprint.name} takes seconds to minutes there;"
                                " the embedded default (--size auto) is a CPU's workload.")
    if batch_size is not None:
        return _given_batch(footprint, gpu, batch_size, processes)
    batch, share = _fitted_batch(footprint, gpu, processes)
    if batch < MULTIPLE:
        short = (f"the real dimensions ({footprint.name}) need an estimated"
                 f" {_gib(process_bytes(footprint, MULTIPLE))} GiB per precision at batch {MULTIPLE}, and"
                 + (" 1 precision has" if processes == 1 else f" {processes} side by side have")
                 + f" {_gib(share)} GiB{'' if processes == 1 else ' each'} ({FILL:.0%} of {_of_free(gpu)})")
        if size == "real":
            raise ValueError(f"--size real: {short}; run fewer --precisions, pass --batch-size to run anyway, or use"
                             " --size embedded.")
        return Workload("embedded", embedded_batch, f"embedded default (the GPU's {_gib(gpu.free_bytes)} GiB free do"
                                                    f" not fit the real size at batch {MULTIPLE}): {short}")
    need = process_bytes(footprint, batch)
    capped = ", the most compare chooses" if batch == MAX_BATCH else ""
    return Workload("real", batch, f"real dimensions ({footprint.name}, batch {batch}{capped}: an estimated"
                                   f" {_gib(need)} GiB per precision{_together(processes)} in"
                                   f" {processes * need / gpu.free_bytes:.0%} of {_of_free(gpu)})")


def _given_batch(footprint: RealSize, gpu: Gpu, batch_size: int, processes: int) -> Workload:
    """``--batch-size`` at the real dimensions on a GPU: it runs as given, with a warning where the estimate says it
    may not fit."""
    share = FILL * gpu.free_bytes / processes
    need = process_bytes(footprint, batch_size)
    warning = None if need <= share else (
        f"--batch-size {batch_size}: {footprint.name} needs an estimated {_gib(need)} GiB per precision"
        f"{_together(processes)}, where {FILL:.0%} of {_of_free(gpu)} leaves {_gib(share)} GiB"
        f"{'' if processes == 1 else ' each'}: the runs may run out of memory.")
    why = f"real dimensions ({footprint.name}, batch {batch_size} from --batch-size, on {gpu.name})"
    return Workload("real", batch_size, why, warning)
