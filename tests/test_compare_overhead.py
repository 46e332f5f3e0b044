"""`lightning-precision compare` made cheaper to start, with the same numbers: the FLOPs per step of each recipe's
embedded default, and the rows of a real comparison equal to those of each precision trained in a process spawned as
the comparison used to (importing torch and Lightning itself); each precision still in a process of its own."""

import json
import multiprocessing

import pytest

import lightning_precision.cli as cli
from lightning_precision.cli import child
from lightning_precision.cli.compare import measure_batch
from lightning_precision.cli.compare_args import parse_args

# Counted with the code that counted them before the processes were forked from a preloaded server (same recipe, same
# batch shape): an integer each, the same on every machine.
FLOPS = {
    ("distilbert", 32): (906_780_672, "tokens", 1536),
    ("vit", 8): (210_794_496, "images", 8),
    ("resnet50", 4): (118_555_648, "images", 4),
}


@pytest.mark.parametrize(("recipe", "batch_size"), list(FLOPS))
def test_the_flops_per_step_and_the_units_per_batch_are_todays(recipe, batch_size):
    flops, unit, units = FLOPS[recipe, batch_size]
    measured = measure_batch(parse_args(["--recipe", recipe, "--batch-size", str(batch_size)]))
    assert measured == {"model_flops_per_step": flops, "unit": unit, "units_per_batch": units}


def _train_spawned(conn, recipe, precision, args):
    """The reference: ``child.train`` in a process that imports everything itself, as every run's process did."""
    losses = []
    result = child.train(recipe, precision, args, on_block=lambda times, block, peak: losses.extend(block))
    conn.send((result, losses))


# The figures of a row that do not depend on time or memory: what must not change when the processes start faster.
NUMBERS = ("losses", "val_acc", "val_samples", "grad_underflow_fp16", "grad_underflow_fp16_scaled", "skipped_steps",
           "steps_done", "compute_kind")


@pytest.mark.slow
def test_the_rows_of_the_embedded_default_are_those_of_a_spawned_run(tmp_path):
    """The embedded default (DistilBERT on generated reviews): every number of every row, and the FLOPs, are those of
    the same precision trained in a process spawned the old way."""
    out = tmp_path / "r"
    argv = ["--steps", "4", "--val-batches", "1", "--precisions", "32-true,bf16-mixed"]
    assert cli.main(["compare", *argv, "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["meta"]["model_flops_per_step"] == FLOPS["distilbert", 32][0]
    args = parse_args(argv)
    context = multiprocessing.get_context("spawn")
    for row in report["results"]:
        parent, end = context.Pipe()
        process = context.Process(target=_train_spawned, args=(end, "distilbert", row["precision"], args))
        process.start()
        assert parent.poll(300), row["precision"]
        result, losses = parent.recv()
        process.join(timeout=60)
        expected = {**{k: result[k] for k in NUMBERS if k in result}, "losses": losses, "steps_done": 4,
                    "compute_kind": "fp32" if result["compute_dtype"] == "torch.float32" else "bf16"}
        assert {k: row.get(k) for k in NUMBERS} == expected, row["precision"]
