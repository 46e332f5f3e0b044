"""Gradients of any dtype are checked for inf/nan without a host read, on every device: the private AMP ops are called
only with the dtypes their CUDA kernels take (``_upstream.torch.CUDA_KERNEL_DTYPES``), and in this suite they refuse
the rest as on a GPU (``tests/cuda_kernels.py``). Before this, ``BF16TruePrecision`` crashed at its first optimizer
step on CUDA, as torch's own ``GradScaler`` does on bf16 gradients (a bf16 submodule under fp16 autocast)."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_precision import BF16MixedPrecision, BF16TruePrecision, FP16MixedPrecision, FP16TruePrecision
from lightning_precision._core.scaling.scaler import check_gradients
from lightning_precision._upstream.torch import CUDA_KERNEL_DTYPES, DispatchCounter, non_finite_check_and_unscale_
from tests.cuda_kernels import cuda_refusal
from tests.helpers import IN, OUT, loader, make_data, trainer

FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


# ---- the fixture refuses what CUDA refuses ---------------------------------------------------------------------------


def test_the_fused_check_refuses_bf16_gradients_here_in_cudas_words():
    grads = [torch.ones(3, dtype=torch.bfloat16)]
    with pytest.raises(NotImplementedError,
                       match=r"^\"_amp_foreach_non_finite_check_and_unscale_cuda\" not implemented for 'BFloat16'$"):
        torch._amp_foreach_non_finite_check_and_unscale_(grads, torch.zeros(()), torch.ones(()))
    for dtype in (torch.float16, torch.float32, torch.float64):  # what its CUDA kernel takes, it takes here
        torch._amp_foreach_non_finite_check_and_unscale_([torch.ones(3, dtype=dtype)], torch.zeros(()), torch.ones(()))
    with pytest.raises(NotImplementedError, match="argument 1 must be a Float tensor, got Double"):
        torch._amp_foreach_non_finite_check_and_unscale_([torch.ones(3)], torch.zeros((), dtype=torch.float64),
                                                         torch.ones(()))


def test_the_scale_update_refuses_what_its_cuda_kernel_refuses():
    scale, tracker, found = torch.ones(()), torch.zeros((), dtype=torch.int32), torch.zeros(())
    torch._amp_update_scale_(scale, tracker, found, 2.0, 0.5, 10)
    with pytest.raises(NotImplementedError, match="argument 1 must be a Int tensor, got Long"):
        torch._amp_update_scale_(scale, tracker.long(), found, 2.0, 0.5, 10)
    assert cuda_refusal("_amp_update_scale_", (scale.double(), tracker, found)) is not None


def test_every_op_of_the_table_is_wrapped_and_exists_in_this_torch():
    for op in CUDA_KERNEL_DTYPES:
        assert getattr(getattr(torch, op), "refuses_like_cuda", False), op


# ---- the check itself ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"), None])
def test_inf_and_nan_are_found_in_every_dtype_and_the_largest_finite_value_is_not(dtype, bad):
    big = torch.finfo(dtype).max
    grads = [torch.tensor([1.0, -big], dtype=dtype), torch.empty(0, dtype=dtype), torch.tensor([4.0], dtype=dtype)]
    if bad is not None:
        grads[2][0] = bad
    found = torch.zeros(())
    non_finite_check_and_unscale_(grads, found, None)
    assert found.item() == (bad is not None)
    assert grads[0].tolist() == [1.0, -big]  # checked, not unscaled


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_unscaling_multiplies_every_dtype_exactly_and_keeps_a_found_flag(dtype):
    grads = [torch.tensor([2.0, -8.0], dtype=dtype), torch.empty(0, dtype=dtype)]
    found = torch.ones(())  # set by an earlier group: a clean group leaves it set
    non_finite_check_and_unscale_(grads, found, torch.tensor(0.25))
    assert grads[0].tolist() == [0.5, -2.0] and grads[0].dtype == dtype and found.item() == 1


def _step_ops(n_params: int, dtype: torch.dtype) -> DispatchCounter:
    params = [nn.Parameter(torch.ones(4, dtype=dtype)) for _ in range(n_params)]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer = torch.optim.SGD(params, lr=0.1)
    one = torch.ones(())
    with DispatchCounter() as ops:
        check_gradients(optimizer, lambda device: one)
    return ops


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_check_dispatches_the_same_ops_for_2_or_40_parameters_and_reads_nothing(dtype):
    """On a GPU every op is a launch: a constant number per (device, dtype) group, never one per parameter; and no
    host read (``aten._local_scalar_dense``)."""
    few, many = _step_ops(2, dtype), _step_ops(40, dtype)
    assert few.names == many.names and few.host_reads == 0
    assert len(few.names) <= 8, few.names


def test_a_mixed_dtype_model_is_checked_once_per_dtype_group():
    ops = [_step_ops(3, d).names for d in (torch.bfloat16, torch.float32)]
    model = nn.ModuleDict({"a": nn.Linear(2, 2).bfloat16(), "b": nn.Linear(2, 2)})
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model["a"].weight.grad[0, 0] = float("nan")
    one = torch.ones(())
    with DispatchCounter() as mixed:
        found = check_gradients(torch.optim.SGD(model.parameters(), lr=0.1), lambda device: one)
    assert sorted(mixed.names) == sorted(["aten.zeros.default", *ops[0][1:], *ops[1][1:]])
    assert found[torch.device("cpu")].item() == 1


# ---- plugins that meet bf16 gradients --------------------------------------------------------------------------------


class MixedDtypes(L.LightningModule):
    """A model with a bf16 submodule (an adapter, say) beside fp32 layers: its gradients come in two dtypes (under the
    true-precision plugins, 16-bit ones and the fp32 ones of the LayerNorm they keep in fp32)."""

    def __init__(self, optimizer: str = "sgd", clip: float | None = None, poison_step: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.adapter, self.head = nn.Linear(IN, 32), nn.Linear(32, 32).bfloat16(), nn.Linear(32, OUT)
        self.norm = nn.LayerNorm(32)
        self.optimizer, self.clip, self.poison_step = optimizer, clip, poison_step
        self.adapter_before: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.relu(self.body(x)))
        return self.head(torch.relu(self.adapter(h.to(self.adapter.weight.dtype)).to(h.dtype)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x).float(), y)

    def on_after_backward(self) -> None:
        if self.global_step == self.poison_step:  # an inf in the bf16 gradients alone: the step must be skipped
            self.adapter.weight.grad[0, 0] = float("inf")
            self.adapter_before = self.adapter.weight.detach().clone()

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        if self.clip is not None:  # unscales first (the plugin's unscale_): the check-and-unscale of both dtypes
            self.clip_gradients(optimizer, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "fused":  # unscales inside step(): torch's scaler checks its gradients before
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _all_finite(module: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in module.parameters())


PLUGINS = {
    "16-mixed": lambda: FP16MixedPrecision(),
    "bf16-mixed guarded": lambda: BF16MixedPrecision(skip_nonfinite=True),
    "bf16-true": lambda: BF16TruePrecision(keep_fp32=(nn.LayerNorm,)),
    "16-true": lambda: FP16TruePrecision(keep_fp32=(nn.LayerNorm,)),
}


@pytest.mark.parametrize("name", list(PLUGINS))
@pytest.mark.parametrize("optimizer", ["sgd", "fused"])
def test_a_model_with_a_bf16_submodule_trains_and_an_inf_in_it_skips_the_step(name, optimizer):
    model = MixedDtypes(optimizer, poison_step=2)
    plugin = PLUGINS[name]()
    trainer(plugin, max_steps=4).fit(model, loader(make_data(4)))
    assert _all_finite(model) and plugin.skipped_steps >= 1
    assert model.adapter_before is not None


@pytest.mark.parametrize("name", ["16-mixed", "bf16-mixed guarded"])
def test_clipping_unscales_bf16_gradients_beside_fp32_ones(name):
    model = MixedDtypes(clip=1.0)
    plugin = PLUGINS[name]()
    trainer(plugin, max_steps=3, gradient_clip_val=1.0).fit(model, loader(make_data(3)))
    assert _all_finite(model) and plugin.skipped_steps == 0


def test_fp16_mixed_skips_the_step_whose_only_inf_is_in_a_bf16_gradient():
    """The weights of every dtype are left as they were on the poisoned step: the one flag covers both groups."""
    model = MixedDtypes(poison_step=0)
    plugin = FP16MixedPrecision(init_scale=2.0**8)
    trainer(plugin, max_steps=1).fit(model, loader(make_data(1)))
    assert plugin.skipped_steps == 1
    torch.testing.assert_close(model.adapter.weight, model.adapter_before, rtol=0, atol=0)


def test_an_fp16_parameter_under_fp16_mixed_is_refused_with_the_fix():
    model = MixedDtypes()
    model.adapter.half()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients: .*FP16TruePrecision"):
        trainer(FP16MixedPrecision(), max_steps=1).fit(model, loader(make_data(1)))


def test_fp8_with_fp16_compute_trains_a_model_with_a_bf16_submodule():
    pytest.importorskip("torchao", reason="needs torchao (`pip install 'lightning-precision[fp8]'`)")
    from lightning_precision import FP8Precision

    model = MixedDtypes(poison_step=1)
    plugin = FP8Precision(compute_dtype=torch.float16, emulate=True, skip_small_layers=False, skip_first_last=False)
    trainer(plugin, max_steps=3).fit(model, loader(make_data(3)))
    assert _all_finite(model) and plugin.skipped_steps >= 1


def test_the_check_runs_inside_fp16_autocast():
    """A step taken inside the forward's autocast region (manual optimization, a Fabric step under
    `fabric.autocast()`): fp16 autocast's `stack` refuses bf16 tensors, so the check steps out of autocast."""
    grads = [torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)]
    found = torch.zeros(())
    with torch.autocast("cpu", dtype=torch.float16):
        non_finite_check_and_unscale_(grads, found, torch.tensor(0.5))
    assert found.item() == 1 and grads[0][0].item() == 0.5


class ManualMixed(MixedDtypes):
    """The optimizer stepped inside `training_step`, under the plugin's fp16 autocast."""

    def __init__(self, poison_step: int) -> None:
        super().__init__(poison_step=poison_step)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        self.manual_backward(super().training_step(batch, batch_idx))
        self.on_after_backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("name", ["16-mixed", "bf16-mixed guarded"])
def test_manual_optimization_checks_bf16_gradients_inside_the_autocast_region(name):
    model = ManualMixed(poison_step=1)
    plugin = PLUGINS[name]()
    trainer(plugin, max_steps=3).fit(model, loader(make_data(3)))
    assert _all_finite(model) and plugin.skipped_steps == 1


def test_a_fabric_step_under_fabric_autocast_checks_bf16_gradients():
    from lightning_precision.fabric import FP16MixedPrecision as FabricFP16

    plugin = FabricFP16()
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = MixedDtypes()
    model = fabric.setup(net)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(net.parameters(), lr=0.05))
    for step, (x, y) in enumerate(loader(make_data(3))):
        with fabric.autocast():
            fabric.backward(nn.functional.cross_entropy(model(x).float(), y))
            if step == 1:
                net.adapter.weight.grad[0, 0] = float("nan")
            optimizer.step()
            optimizer.zero_grad()
    assert _all_finite(net) and plugin.skipped_steps == 1
