"""Lightning's DDP strategy on CPU: gloo backend, 2 processes (spawned), real all-reduce."""

import json
import math

import pytest
import torch
from torch import nn

from lightning_precision import BF16MixedPrecision, BF16TruePrecision, FP16MixedPrecision
from tests.distributed import fit_spawned
from tests.helpers import LitNet, loader, make_data, make_net, trainer


class RankReport(LitNet):
    """Rank 0 alone gets an overflowing batch at step 2 (times 1e6, or times NaN); every rank writes what it ended
    with."""

    def __init__(self, out_dir: str, poison: float = 1e6):
        super().__init__()
        self.out_dir = out_dir
        self.poison = poison

    def training_step(self, batch, batch_idx):
        x, y = batch
        if batch_idx == 2 and self.global_rank == 0:
            x = x * self.poison
        return super().training_step((x, y), batch_idx)

    def on_train_end(self):
        plugin = self.trainer.precision_plugin
        report = {
            "rank": self.global_rank,
            "backend": torch.distributed.get_backend(),
            "precision": plugin.precision,
            "loss_scale": getattr(plugin, "loss_scale", None),
            "skipped_steps": getattr(plugin, "skipped_steps", None),
            "weights": [p.detach().double().sum().item() for p in self.parameters()],
        }
        with open(f"{self.out_dir}/rank{self.global_rank}.json", "w") as f:
            json.dump(report, f)


@pytest.mark.parametrize("plugin_cls", [FP16MixedPrecision, BF16MixedPrecision])
def test_ddp_gloo_two_processes_agree(tmp_path, plugin_cls):
    plugin = plugin_cls(init_scale=1024.0) if plugin_cls is FP16MixedPrecision else plugin_cls()
    t = trainer(plugin, strategy="ddp_spawn", devices=2, max_steps=5)
    reports = fit_spawned(t, RankReport(str(tmp_path)), loader(make_data(10)), tmp_path)
    assert [r["backend"] for r in reports] == ["gloo", "gloo"]
    assert reports[0]["precision"] == reports[1]["precision"] == plugin.precision
    assert reports[0]["weights"] == reports[1]["weights"]  # replicas stayed identical
    if plugin_cls is FP16MixedPrecision:
        # rank 1's gradients were finite, but the all-reduce carried rank 0's inf to it: both skipped, both backed off
        assert [r["skipped_steps"] for r in reports] == [1, 1]
        assert [r["loss_scale"] for r in reports] == [512.0, 512.0]


def test_ddp_bf16_a_nan_on_one_rank_is_skipped_on_every_rank(tmp_path):
    """Rank 0's loss turns NaN at step 2; the all-reduce carries the NaN into rank 1's gradients: the non-finite guard
    skips that step on both ranks, their replicas stay identical and finite, and both count it."""
    t = trainer(BF16MixedPrecision(skip_nonfinite=True), strategy="ddp_spawn", devices=2, max_steps=5)
    reports = fit_spawned(t, RankReport(str(tmp_path), poison=float("nan")), loader(make_data(10)), tmp_path)
    assert reports[0]["weights"] == reports[1]["weights"]
    assert all(math.isfinite(w) for w in reports[0]["weights"])
    assert [r["skipped_steps"] for r in reports] == [1, 1] and [r["loss_scale"] for r in reports] == [None, None]


class MonitorReport(LitNet):
    """The issue's underflow case (loss times 1e-5 at loss scale 1) under DDP; every rank writes what it logged."""

    def __init__(self, out_dir: str):
        super().__init__()
        self.out_dir = out_dir

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * 1e-5

    def on_train_end(self):
        logged = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith("precision/")}
        (monitor,) = [c for c in self.trainer.callbacks if type(c).__name__ == "GradientUnderflowMonitor"]
        logged["histogram"] = monitor.histogram.tolist()
        with open(f"{self.out_dir}/rank{self.global_rank}.json", "w") as f:
            json.dump(logged, f)


def test_the_fp16_probe_runs_under_ddp_and_every_rank_logs_the_same(tmp_path):
    """The probe backward (torch.autograd.grad with retain_graph) runs before DDP's own backward: no gradient hook of
    DDP's fires for it, nothing hangs, and the counts are all-reduced like every other."""
    from lightning_precision.callbacks import GradientUnderflowMonitor

    monitor = GradientUnderflowMonitor(formats="fp16", top_k=0, warn_threshold=1.0)
    t = trainer(FP16MixedPrecision(init_scale=1.0), strategy="ddp_spawn", devices=2, max_steps=2, log_every_n_steps=1,
                callbacks=[monitor])
    reports = fit_spawned(t, MonitorReport(str(tmp_path)), loader(make_data(4)), tmp_path)
    assert reports[0] == reports[1]  # the histogram too: summed across ranks
    assert reports[0]["precision/underflow/fp16/lost"] > 0.1
    # DDP's gradients are the same on every rank: they enter the histogram once (from rank zero), not once per rank.
    n_params = sum(p.numel() for p in make_net().parameters())
    assert 0 < sum(reports[0]["histogram"]) <= 2 * n_params


class EvalRank(LitNet):
    """Validates twice during a DDP fit; every rank writes the dtypes its validation saw (the batch as the step got it,
    the output, a weight outside its layer's forward) and its weights."""

    def __init__(self, out_dir: str):
        super().__init__()
        self.out_dir = out_dir
        self.seen: list[list[str]] = []

    def val_dataloader(self):
        return loader(make_data(2, seed=7))

    def validation_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        self.seen.append([str(x.dtype), str(out.dtype), str(self.net[0].weight.dtype)])
        self.log("val_loss", nn.functional.cross_entropy(out.float(), y), sync_dist=True)

    def on_train_end(self):
        report = {"seen": self.seen, "dtypes": sorted({str(p.dtype) for p in self.parameters()}),
                  "weights": [p.detach().double().sum().item() for p in self.parameters()]}
        with open(f"{self.out_dir}/rank{self.global_rank}.json", "w") as f:
            json.dump(report, f)


@pytest.mark.slow  # two spawned ranks: the DDP wrapper's own behaviour, not the torch version's
def test_ddp_validation_runs_in_eval_precision_on_every_rank_and_training_stays_16_bit(tmp_path):
    """``eval_precision="32-true"`` under ``ddp_spawn``: the plugin is pickled into each rank and finds the
    LightningModule inside DDP's wrapper at ``connect``, so the batch reaches the validation step in fp32 (not rounded
    through bf16), the step computes in fp32 on the bf16 weights, and the weights stay bf16 and identical on both
    ranks."""
    t = trainer(BF16TruePrecision(eval_precision="32-true"), strategy="ddp_spawn", devices=2, max_steps=4,
                val_check_interval=2, limit_val_batches=1)
    reports = fit_spawned(t, EvalRank(str(tmp_path)), loader(make_data(10)), tmp_path)
    for report in reports:
        # the batch and the output fp32; a weight read outside its layer's forward bf16: one layer widened at a time
        assert report["seen"] and all(seen == ["torch.float32", "torch.float32", "torch.bfloat16"]
                                      for seen in report["seen"]), report["seen"]
        assert report["dtypes"] == ["torch.bfloat16"]
    assert reports[0]["weights"] == reports[1]["weights"]
