"""No measuring callback measures another's pass (issue 36): GradientUnderflowMonitor's probe backward (the step's
graph again, at 2**16 times the loss scale) and MFUMonitor's FLOP count (a forward and backward of the first batch)
are no training step for AmaxHistoryLogger, GradientUnderflowMonitor's activation hooks, FP8Guard or the
``layers="auto"`` calibration. Each callback, fitted beside all the others, records exactly what it records alone:
the training is the same (neither pass changes a weight), so any difference is a pass measured.

Real Trainer fits, real torchao (emulated fp8 on the CPU)."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

import lightning_precision as lp
from lightning_precision.callbacks import AmaxHistoryLogger, FP8Guard, GradientUnderflowMonitor, MFUMonitor
from lightning_precision.fp8._sensitivity import SensitivityProbe
from tests.helpers import RecordingLogger, assert_same_bits, trainer

STEPS = 4


class _Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(batch).float().square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def _loss(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return module.training_step(batch, 0)  # type: ignore[operator]


def _fp8(**kw: Any) -> Any:
    return lp.FP8Precision(emulate=True, skip_small_layers=False, skip_first_last=False, **kw)


PLUGINS = {
    "bf16-mixed": lp.BF16MixedPrecision,
    "fp16-mixed": lp.FP16MixedPrecision,
    "bf16-true": lp.BF16TruePrecision,
    "fp16-true": lp.FP16TruePrecision,
    # fp16 compute: the monitor's probe runs, through fp8 layers the guard measures
    "fp8-fp16": lambda: _fp8(compute_dtype=torch.float16),
    # the calibration's probe beside the monitor's probe and the FLOP count
    "fp8-auto": lambda: _fp8(compute_dtype=torch.float16, layers="auto", calibration_batches=2),
}
CALLBACKS = {
    "amax": lambda: AmaxHistoryLogger(log_every_n_steps=1, block_formats=()),
    "monitor": lambda: GradientUnderflowMonitor(measure_every_n_steps=1, log_every_n_steps=1, activations=True,
                                                warn_threshold=1.0),
    "mfu": lambda: MFUMonitor(loss_fn=_loss, peak_tflops=1.0, log_every_n_steps=1),
    "guard": lambda: FP8Guard(every_n_steps=1),
}


def _fit(plugin_name: str, names: list[str], tmp_path: Any, monkeypatch: Any) -> dict[str, Any]:
    """What each callback of ``names`` recorded: its logged metrics, and for the amax logger its history, for the guard
    what its probes measured (read from `SensitivityProbe.result`, which it calls)."""
    measured: list[Any] = []
    real_result = SensitivityProbe.result

    def result(self: SensitivityProbe, *args: Any, **kwargs: Any) -> Any:
        out = real_result(self, *args, **kwargs)
        measured.append(out)
        return out

    monkeypatch.setattr(SensitivityProbe, "result", result)
    callbacks = {name: CALLBACKS[name]() for name in names}
    plugin = PLUGINS[plugin_name]()
    logger = RecordingLogger()
    run = trainer(plugin, max_steps=STEPS, callbacks=list(callbacks.values()), logger=logger, log_every_n_steps=1,
                  default_root_dir=tmp_path)
    model = _Net()
    g = torch.Generator().manual_seed(1)
    run.fit(model, torch.utils.data.DataLoader([torch.randn(8, 32, generator=g) for _ in range(STEPS)],
                                               batch_size=None))
    logged: dict[str, list[float]] = {}  # every step's value of each key
    for _, metrics in logger.logged:
        for k, v in metrics.items():
            logged.setdefault(k, []).append(v)
    prefixes = {"amax": ("precision/amax/", "precision/fp8_scale/", "precision/fp8_whatif/"),
                "monitor": ("precision/underflow", "precision/overflow", "precision/act_", "precision/exact_zero",
                            "precision/recommended"),
                "guard": ("precision/fp8_kurtosis/", "precision/fp8_amax_growth/", "precision/fp8_demoted/")}
    out: dict[str, Any] = {"weights": [p.detach().float().clone() for p in model.parameters()]}
    for name, callback in callbacks.items():
        if name in prefixes:  # MFUMonitor's logged figures are times: its FLOP count is what it measures
            out[name] = {k: v for k, v in logged.items() if k.startswith(prefixes[name])}
        if name == "amax":
            out["amax/history"] = callback.history
        if name == "mfu":
            out["mfu/flops"] = callback.measured_flops
        if name == "guard":
            out["guard/measured"] = [{fqn: str(s) for fqn, s in m.items()} for m in measured]
    if plugin_name == "fp8-auto":
        out["plan"] = [(d.fqn, d.fp8, d.format) for d in plugin.layer_decisions]
        out["calibration"] = measured[:1]  # the calibration's own read comes first
    return out


def _check(plugin_name: str, tmp_path: Any, monkeypatch: Any) -> None:
    names = [n for n in CALLBACKS if n != "guard" or plugin_name.startswith("fp8")]
    together = _fit(plugin_name, names, tmp_path / "together", monkeypatch)
    for name in names:
        alone = _fit(plugin_name, [name], tmp_path / name, monkeypatch)
        assert_same_bits(together["weights"], alone["weights"], f"{name}: the training itself")
        for key in alone:
            if key == name or key.startswith(f"{name}/") or (key in ("plan", "calibration") and name == "mfu"):
                value = alone[key]  # it measured something: the comparison is not vacuous
                assert (value.numel() if isinstance(value, torch.Tensor) else value), (name, key)
                assert_same_bits(together[key], alone[key], f"{plugin_name}: {key} beside the others")
        if plugin_name == "fp8-auto":
            assert together["plan"] == alone["plan"], name


def test_no_callback_measures_anothers_pass_under_fp16_mixed(tmp_path, monkeypatch):
    """Where the bug was seen: the amax logger recorded the monitor's probe backward as a step."""
    _check("fp16-mixed", tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("plugin_name", [p for p in PLUGINS if p != "fp16-mixed"])
def test_no_callback_measures_anothers_pass(plugin_name, tmp_path, monkeypatch):
    pytest.importorskip("torchao")
    _check(plugin_name, tmp_path, monkeypatch)


def test_a_probe_through_fabrics_backward_is_no_calibration_batch():
    """With Fabric the probe runs inside ``fabric.backward`` (the only backward Fabric lets through its model's
    outputs): the plugin's after-backward, where ``layers="auto"`` counts its batches, must not count it."""
    pytest.importorskip("torchao")
    from lightning_precision import fabric as lp_fabric

    plugin = lp_fabric.FP8Precision(emulate=True, skip_small_layers=False, skip_first_last=False,
                                    compute_dtype=torch.float16, layers="auto", calibration_batches=2)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = _Net().net
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=1e-2))
    monitor = GradientUnderflowMonitor(warn_threshold=1.0)
    g = torch.Generator().manual_seed(1)
    decided = []
    for _ in range(2):
        loss = model(torch.randn(8, 32, generator=g)).float().square().mean()
        monitor.probe_backward(loss, model.named_parameters(), plugin.loss_scale, backward=fabric.backward)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        decided.append(plugin.plan_in_force() is not None)
    assert decided == [False, True]  # two real batches measured, not one batch and its probe
