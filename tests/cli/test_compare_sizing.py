"""`compare`'s workload: the pure choice of size and batch from given device facts (a CPU, GPUs of several sizes, the
options), the recipes' real dimensions (built on the meta device: nothing runs, nothing is allocated), the figures
sizing rests on (recounted), the facts gathered from torch.cuda (mocked: no GPU here), which rows compile, and the
report's line. One real run on a GPU, where one is lent (marked cuda)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from lightning_precision import _imports
from lightning_precision.cli.compare import args as compare_args
from lightning_precision.cli.compare import main as compare_main
from lightning_precision.cli.compare import report as lp_report
from lightning_precision.cli.compare import sizing
from lightning_precision.cli.compare.rows import Row
from lightning_precision.cli.recipes import RECIPES, RealSize
from lightning_precision.cli.recipes.text import DistilBertClassifier
from lightning_precision.cli.recipes.vision import Bottleneck, ViTClassifier
from tests.runif import RunIf

with _imports.quiet_known_noise():  # DistilBERT's classes take a second and a half to import: once, at collection
    from transformers import DistilBertForSequenceClassification  # noqa: F401

GIB = 2**30
VIT = RECIPES["vit"].real
assert VIT is not None
# An H200 as torch.cuda reports it (../shared/GPU.md): 139.8 GiB, the command's own CUDA context already taken.
H200 = sizing.Gpu("NVIDIA H200", int(139.8 * GIB), int(139.3 * GIB))
A100_40GB = sizing.Gpu("NVIDIA A100-SXM4-40GB", int(39.4 * GIB), int(39.0 * GIB))
T4 = sizing.Gpu("Tesla T4", 15 * GIB, int(14.5 * GIB))


# ---------------------------------------------------------------------------------------------- the choice, pure


@pytest.mark.parametrize("batch", [None, 8])
def test_a_cpu_runs_the_embedded_default_as_before(batch):
    workload = sizing.choose_workload("auto", VIT, None, batch, processes=3)
    assert (workload.size, workload.batch_size, workload.warning) == ("embedded", batch or 32, None)
    assert workload.line == "workload: embedded CPU default (no CUDA GPU)"
    forced_cpu = sizing.choose_workload("auto", VIT, None, None, 3, no_gpu="--accelerator cpu")
    assert forced_cpu.why == "embedded CPU default (--accelerator cpu)"


def _fits(footprint: RealSize, gpu: sizing.Gpu, batch: int, processes: int) -> bool:
    return processes * sizing.process_bytes(footprint, batch) <= sizing.FILL * gpu.free_bytes


# batches worked by hand from RealSize's figures: (FILL * free / processes - 1 GiB - 18 B x parameters) / activations
@pytest.mark.parametrize(("recipe", "gpu", "processes", "batch"), [
    ("vit", H200, 4, 144),  # 24.4 GiB each - 1 - 1.44 = 21.9 GiB over 154.6 MiB a sample: 145 -> 144
    ("vit", H200, 5, 112),
    ("vit", A100_40GB, 4, 24),
    ("resnet50", H200, 5, 224),
    ("resnet50", A100_40GB, 4, 64),
    ("distilbert", A100_40GB, 4, 96),
    ("distilbert", T4, 4, 8),
])
def test_a_gpu_runs_the_real_dimensions_at_the_largest_batch_that_fits(recipe, gpu, processes, batch):
    real = RECIPES[recipe].real
    workload = sizing.choose_workload("auto", real, gpu, None, processes)
    assert (workload.size, workload.batch_size, workload.warning) == ("real", batch, None)
    assert batch % 8 == 0 and _fits(real, gpu, batch, processes) and not _fits(real, gpu, batch + 8, processes)
    share = f"{processes * sizing.process_bytes(real, batch) / gpu.free_bytes:.0%}"  # of the free memory, as fitted
    assert workload.line.startswith(f"workload: real dimensions ({real.name}, batch {batch}: an estimated ")
    assert workload.line.endswith(f" GiB per precision, {processes} side by side in {share} of the"
                                  f" {gpu.free_bytes / GIB:.0f} GiB free of the {gpu.total_bytes / GIB:.0f} GiB of"
                                  f" {gpu.name})")


def test_the_batch_is_capped_where_every_matmul_is_full_already():
    workload = sizing.choose_workload("auto", RECIPES["distilbert"].real, H200, None, 4)
    assert workload.batch_size == sizing.MAX_BATCH == 256
    assert workload.why.startswith("real dimensions (DistilBERT-base, 128 tokens, batch 256, the most compare chooses:"
                                   " an estimated 15 GiB per precision, 4 side by side in 42% of the 139 GiB free of"
                                   " the 140 GiB of NVIDIA H200")


def test_an_explicit_batch_size_wins_and_is_warned_where_it_may_not_fit():
    fits = sizing.choose_workload("auto", VIT, H200, 64, 4)
    assert (fits.size, fits.batch_size, fits.warning) == ("real", 64, None)
    assert fits.why == "real dimensions (ViT-B/16, 224x224, batch 64 from --batch-size, on NVIDIA H200)"
    tight = sizing.choose_workload("real", VIT, T4, 64, 4)
    assert tight.batch_size == 64 and tight.warning is not None
    assert "--batch-size 64: ViT-B/16, 224x224 needs an estimated 12 GiB per precision" in tight.warning
    assert "may run out of memory" in tight.warning
    assert sizing.choose_workload("embedded", VIT, H200, 64, 4).batch_size == 64  # embedded: as given, as before


def test_size_forces_either_way():
    embedded = sizing.choose_workload("embedded", VIT, H200, None, 4)
    assert (embedded.size, embedded.batch_size, embedded.why) == ("embedded", 32, "embedded default (--size"
                                                                                  " embedded)")  # on the GPU
    assert sizing.choose_workload("embedded", VIT, None, None, 4).why == "embedded CPU default (--size embedded)"
    on_cpu = sizing.choose_workload("real", VIT, None, None, 2)
    assert (on_cpu.size, on_cpu.batch_size) == ("real", sizing.REAL_CPU_BATCH)
    assert on_cpu.why == "real dimensions (ViT-B/16, 224x224, batch 8: --size real, no CUDA GPU)"
    assert on_cpu.warning is not None and "seconds to minutes" in on_cpu.warning
    assert sizing.choose_workload("real", VIT, None, 16, 2).batch_size == 16


def test_a_gpu_too_small_for_the_least_batch_falls_back_or_refuses_with_the_fix():
    """auto: the embedded default, the reason in the report; --size real: a usage error naming the ways out."""
    fallback = sizing.choose_workload("auto", VIT, T4, None, 4)
    assert (fallback.size, fallback.batch_size) == ("embedded", 32)
    assert fallback.why == ("embedded default (the GPU's 14 GiB free do not fit the real size at batch 8): the real"
                            " dimensions (ViT-B/16, 224x224) need an estimated 3.6 GiB per precision at batch 8, and 4"
                            " side by side have 2.5 GiB each (70% of the 14 GiB free of the 15 GiB of Tesla T4)")
    alone = sizing.choose_workload("auto", VIT, sizing.Gpu("GPU", 4 * GIB, 4 * GIB), None, 1)
    assert "at batch 8, and 1 precision has 2.8 GiB (70% of the 4.0 GiB free of the 4.0 GiB of GPU)" in alone.why
    warned = sizing.choose_workload("real", VIT, T4, 64, 1).warning
    assert "12 GiB per precision, where 70% of the 14 GiB free of the 15 GiB of Tesla T4 leaves 10 GiB: the runs" in \
        str(warned)
    with pytest.raises(ValueError, match=r"--size real: the real dimensions .* need an estimated 3\.6 GiB .* run fewer"
                                         r" --precisions, pass --batch-size to run anyway, or use --size embedded\."):
        sizing.choose_workload("real", VIT, T4, None, 4)


def test_bad_calls_are_refused_by_name():
    with pytest.raises(ValueError, match="--size 'large': use one of auto, embedded, real"):
        sizing.choose_workload("large", VIT, None, None, 1)
    with pytest.raises(ValueError, match="at least one precision"):
        sizing.choose_workload("auto", VIT, H200, None, 0)
    for batch in (0, -8):  # 0 would have stood for "not given", a negative one for itself
        with pytest.raises(ValueError, match=rf"choose_workload\(batch_size={batch}\): a batch holds at least 1"):
            sizing.choose_workload("real", VIT, H200, batch, 2)
    with pytest.raises(ValueError, match="--size real: this recipe has no real dimensions"):
        sizing.choose_workload("real", None, H200, None, 2)
    assert sizing.choose_workload("auto", None, H200, None, 2).size == "embedded"


# ------------------------------------------------------------------------------------- the recipes' real dimensions


def test_the_real_dimensions_are_the_published_networks():
    """Built on the meta device (no memory, no initialisation cost): the shapes and the parameter counts the sizing
    uses. The CPU defaults are untouched."""
    with torch.device("meta"):
        bert = RECIPES["distilbert"].sized("real").build()[0]
        vit = RECIPES["vit"].sized("real").build()[0]
        resnet = RECIPES["resnet50"].sized("real").build()[0]
    assert isinstance(bert, DistilBertClassifier) and isinstance(vit, ViTClassifier)
    config = bert.net.config
    assert (config.n_layers, config.dim, config.n_heads, config.hidden_dim, config.vocab_size) == (6, 768, 12, 3072,
                                                                                                   30522)
    assert RECIPES["distilbert"].real.data_args["max_length"] == 128
    layer = vit.net.encoder.layers[0]
    assert vit.image_size == 224 and vit.net.patch_embed.kernel_size == (16, 16) and len(vit.net.encoder.layers) == 12
    assert (layer.self_attn.embed_dim, layer.self_attn.num_heads, layer.linear1.out_features) == (768, 12, 3072)
    blocks = [m for m in resnet.net if isinstance(m, Bottleneck)]
    assert len(blocks) == 16 and resnet.net[0].in_channels == 3 and resnet.net[0].out_channels == 64  # 3+4+6+3
    for name, model in (("distilbert", bert), ("vit", vit), ("resnet50", resnet)):
        assert sum(p.numel() for p in model.parameters()) == RECIPES[name].real.parameters, name
    for name in ("vit", "resnet50"):
        assert RECIPES[name].real.data_args == {"image_size": 224, "channels": 3, "num_classes": 10, "on_the_fly": True}
    assert RECIPES["vit"].sized("embedded") is RECIPES["vit"]
    assert RECIPES["vit"].model_args == {"size": "tiny", "num_classes": 10, "channels": 3}  # the CPU default, as ever
    with pytest.raises(ValueError, match=r"`RECIPES\['vit'\].sized\('large'\)`: use 'embedded' or 'real'"):
        RECIPES["vit"].sized("large")


def _saved_bytes(model: torch.nn.Module, batch: tuple) -> int:
    """Bytes of the tensors autograd saves for the backward of one training loss, each tensor once."""
    kept: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[id(t)] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.training_loss(batch)
    return sum(t.numel() * t.element_size() for t in kept.values())


def _meta_batch(name: str, n: int) -> tuple:
    labels = torch.empty(n, dtype=torch.long, device="meta")
    if name == "distilbert":  # no attention mask: on meta, transformers cannot read one to decide to drop it
        return torch.empty(n, 128, dtype=torch.long, device="meta"), None, labels
    return torch.empty(n, 3, 224, 224, device="meta"), labels


@pytest.mark.parametrize("name", list(RECIPES))
def test_the_activation_bytes_sizing_rests_on_are_counted_not_guessed(name):
    """Recounted as the RealSize comment says (meta device, batch 2 less batch 1, which cancels what does not grow with
    the batch: the weights' transposed views): a model that changes changes its figure, or this fails."""
    with torch.device("meta"):
        model = RECIPES[name].sized("real").build()[0]
    per_sample = _saved_bytes(model, _meta_batch(name, 2)) - _saved_bytes(model, _meta_batch(name, 1))
    assert per_sample == pytest.approx(RECIPES[name].real.activation_bytes, rel=0.05)


# ------------------------------------------------------------------------------------------ the facts, and compiling


def _args(**kw) -> argparse.Namespace:
    base = dict(recipe="vit", size="auto", batch_size=32, batch_size_given=False, accelerator="auto",
                precisions=["32-true", "bf16-mixed", "16-mixed", "fp8"], emulate=False, user=None)
    return argparse.Namespace(**{**base, **kw})


def test_the_device_facts_are_read_from_torch_cuda_and_set_on_the_args(monkeypatch):
    """torch.cuda mocked (no GPU here): what main reads, and what it hands to the runs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (H200.free_bytes, H200.total_bytes))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: H200.name)
    args = _args()
    workload = compare_main.choose_workload(args)
    assert (args.size, args.batch_size) == ("real", 144) and workload.why.startswith("real dimensions (ViT-B/16")
    given = _args(batch_size=48, batch_size_given=True)
    assert compare_main.choose_workload(given).batch_size == 48 and given.size == "real"
    on_cpu = _args(accelerator="cpu")
    assert compare_main.choose_workload(on_cpu).why == "embedded CPU default (--accelerator cpu)"
    assert (on_cpu.size, on_cpu.batch_size) == ("embedded", 32)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (T4.free_bytes, T4.total_bytes))
    with pytest.raises(compare_args.UsageError, match="--size real: the real dimensions"):
        compare_main.choose_workload(_args(size="real"))


def test_only_fp8_rows_on_fp8_hardware_compile(monkeypatch):
    """A CUDA GPU with fp8 mocked (none here): fp8 and fp8-auto compile, the other rows stay eager; on a CPU, or with
    emulated fp8, nothing compiles."""
    import lightning_precision.fp8._hardware as hardware

    assert not any(compare_args.compiled(p, _args()) for p in compare_args.PRECISIONS)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hardware, "fp8_gpu_available", lambda: False)
    assert not any(compare_args.compiled(p, _args()) for p in compare_args.PRECISIONS)  # emulated fp8: eager
    monkeypatch.setattr(hardware, "fp8_gpu_available", lambda: True)
    assert [p for p in compare_args.PRECISIONS if compare_args.compiled(p, _args())] == ["fp8", "fp8-auto"]
    assert not compare_args.compiled("fp8", _args(accelerator="cpu"))


def test_size_is_an_option_with_its_choices(capsys):
    assert compare_args.parse_args(["--size", "real"]).size == "real"
    parsed = compare_args.parse_args([])
    assert (parsed.size, parsed.batch_size, parsed.batch_size_given) == ("auto", 32, False)
    assert compare_args.parse_args(["--batch-size", "32"]).batch_size_given
    with pytest.raises(SystemExit):
        compare_args.parse_args(["--size", "large"])
    assert "invalid choice: 'large'" in capsys.readouterr().err


# -------------------------------------------------------------------------------------------------------- the report


META = {"recipe": "vit", "task": "orientation of generated gratings, 224x224 RGB (10 classes)", "chance": 0.1,
        "steps": 10, "batch_size": 144, "seed": 0, "val_batches": 8, "device": "NVIDIA H200", "schedule": "interleaved",
        "machine_line": "an H200", "machine": {"packages": {}}, "notes": [], "verdict": "v", "interrupted": False,
        "workload": "real dimensions (ViT-B/16, 224x224, batch 144: an estimated 24 GiB per precision, 4 side by side"
                    " in 69% of the 139 GiB free of the 140 GiB of NVIDIA H200)", "compiled": ["fp8"]}


def test_the_report_says_which_size_ran_and_why_and_which_rows_compiled():
    from rich.console import Console

    rows = [Row.from_dict({"precision": p, "median_step_ms": 10.0, "steps_done": 10}) for p in ("32-true", "fp8")]
    md = lp_report.markdown(rows, META, [])
    assert f"- Workload: {META['workload']}\n" in md
    console = Console(width=400, record=True)
    lp_report.print_table(rows, META, console)
    printed = console.export_text()
    assert f"workload: {META['workload']}" in printed
    compiled = [n for n in lp_report.notes(rows, META) if "compiled" in n]
    assert compiled == ["fp8: compiled (torch.compile of the LightningModule, compiling in the untimed first steps),"
                        " the other rows eager: fp8's casts are fused only when compiled, and eager fp8 is slower than"
                        " bf16."]
    assert not [n for n in lp_report.notes(rows, {**META, "compiled": []}) if "compiled" in n]


# ------------------------------------------------------------------------------------------------------- on a GPU


@pytest.mark.cuda
@pytest.mark.slow
@RunIf(cuda=True)
def test_on_a_gpu_the_real_dimensions_run_within_their_estimate(tmp_path):
    """On a CUDA GPU: the real ResNet50 at the batch sizing chose, every row's peak memory within the estimate each
    process was given (the allocator's figure: the CUDA context is outside it), the report saying so."""
    from lightning_precision import cli

    out = tmp_path / "r"
    code = cli.main(["compare", "--recipe", "resnet50", "--steps", "6", "--val-batches", "1", "--precisions",
                     "32-true,bf16-mixed", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    meta = report["meta"]
    assert meta["size"] == "real" and meta["workload"].startswith("real dimensions (ResNet50, 224x224, batch")
    assert meta["batch_size"] % 8 == 0 and meta["units_per_batch"] == meta["batch_size"]
    estimate = sizing.process_bytes(RECIPES["resnet50"].real, meta["batch_size"]) - sizing.CONTEXT_BYTES
    for row in report["results"]:
        assert row["peak_memory_mb"] * 2**20 <= estimate, row["precision"]
    assert f"- Workload: {meta['workload']}" in (out / "report.md").read_text()
