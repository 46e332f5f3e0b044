"""Edges of the step policy (``lightning_precision/_core/scaling/step_policy.py``) and of the process-wide effects
(``_core/process_effects.py``) under Fabric: a plugin copied or pickled where Fabric leaves it (between an optimizer
step and the next backward, its update pending), a plugin's scaler moved to another device in that state, copies
and the ThroughputMonitor's dtype, and the true-precision step hook with two plugins alive."""

import copy
import gc
import pickle
from pathlib import Path

import lightning as L
import lightning.fabric.utilities.throughput as fabric_monitor
import lightning.pytorch.callbacks.throughput_monitor as trainer_monitor
import torch
from torch import nn

import lightning_precision
from lightning_precision._core.process_effects import FABRIC_THROUGHPUT, STATE_INIT_HOOK, TRAINER_THROUGHPUT
from lightning_precision.fabric import BF16MixedPrecision, BF16TruePrecision, FP16MixedPrecision, FP16TruePrecision
from tests.helpers import fabric_loop, loader, make_data, make_net

ROOT = Path(__file__).resolve().parents[2]


def _batches() -> list:
    """Six batches: 1 and 4 overflow fp16 (the loss scaler skips them), 2 and 5 hold a NaN (every policy that checks
    skips them)."""
    ds = make_data(6, overflow_batches=(1, 4))
    for b in (2, 5):
        ds.tensors[0][b * 8] = float("nan")
    return list(loader(ds))


def _train(plugin, net, optimizer, batches) -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, opt = fabric.setup(net, optimizer)
    for x, y in batches:
        opt.zero_grad()
        fabric.backward(nn.functional.cross_entropy(model(x).float(), y))
        opt.step()


def test_a_copy_taken_between_a_step_and_its_update_carries_the_policy_and_trains_on_identically():
    """deepcopy and pickle (ddp_spawn) of each policy's plugin where Fabric rests, the last step's update pending: the
    copy has the same kind of policy, the same state and the same scaler (one object, the loss scaler and the policy's),
    and three more steps (a skip among them) give it the original's weights, counts and scale bit for bit."""
    batches = _batches()
    plugins = {"loss-scaled": FP16MixedPrecision(init_scale=1024.0, growth_interval=2),
               "guarded": BF16MixedPrecision(skip_nonfinite=True),
               "plain": BF16MixedPrecision(),
               "true, loss-scaled": FP16TruePrecision(update="nearest", init_scale=1024.0, growth_interval=2)}
    for kind, plugin in plugins.items():
        net = make_net(0)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        _train(plugin, net, optimizer, batches[:3])
        assert plugin.step_policy.kind == kind.split(", ")[-1]
        assert plugin.step_policy.update_pending == (kind != "plain"), kind
        start = copy.deepcopy((net, optimizer))  # the optimizer's states go with their parameters
        copies = [copy.deepcopy(plugin), pickle.loads(pickle.dumps(plugin))]
        runs = []
        for twin in copies:
            assert type(twin.step_policy) is type(plugin.step_policy), kind
            assert twin.state_dict() == plugin.state_dict(), kind
            assert twin.scaler is twin.step_policy.loss_scaler
            assert (twin.scaler is None) == (not kind.endswith("loss-scaled"))
            assert twin.scaler is None or twin.scaler is twin.step_policy.scaler  # one scaler, not two copies
            twin_net, twin_optimizer = copy.deepcopy(start)
            _train(twin, twin_net, twin_optimizer, batches[3:])
            runs.append((twin, twin_net))
        _train(plugin, net, optimizer, batches[3:])
        for twin, twin_net in runs:
            assert (twin.skipped_steps, twin.loss_scale) == (plugin.skipped_steps, plugin.loss_scale), kind
            for a, b in zip(twin_net.parameters(), net.parameters(), strict=True):
                # (plain: the NaN batch reached the weights, the same NaNs in both)
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
                assert torch.isfinite(a).all() != (kind == "plain"), kind
        assert plugin.skipped_steps == {"loss-scaled": 4, "guarded": 2, "plain": 0, "true, loss-scaled": 4}[kind]


def test_a_scaler_moved_to_another_device_keeps_the_step_whose_update_was_pending():
    """A plugin reused on another device type rebuilds its scaler there from the state: taken while the last step's
    update was pending (where Fabric leaves it), that step was lost, and the next update failed on torch's
    ``Attempted update but _scale is None`` (the new scaler had no record of it). The update is applied first now."""
    for plugin, skipped, scale in ((FP16MixedPrecision(), 1, 2.0**15),
                                   (BF16MixedPrecision(skip_nonfinite=True), 1, None)):
        ds = make_data(2, overflow_batches=(1,))
        ds.tensors[0][8] = float("nan")  # batch 1: skipped by either policy
        fabric_loop(plugin, ds, 2)
        assert plugin.step_policy.update_pending
        plugin.step_policy.on_device("meta")  # another device type, and back (no other one exists here)
        plugin.step_policy.on_device("cpu")
        assert (plugin.skipped_steps, plugin.loss_scale) == (skipped, scale)
        assert plugin.state_dict()["optimizer_steps"] == 2


def test_a_copy_keeps_the_throughput_monitors_dtype_once_the_original_is_collected():
    """Lightning's ThroughputMonitor learns a plugin's dtype from a wrap the plugins hold while they live. A copy (or an
    unpickled plugin) is made without ``__init__``: it held nothing, and once the original was collected the monitor
    took it for fp32 (MFU against fp32's peak)."""
    plugin = lightning_precision.FP16MixedPrecision()
    copies = [copy.deepcopy(plugin), pickle.loads(pickle.dumps(plugin))]
    del plugin
    gc.collect()
    for twin in copies:
        assert any(h is twin for h in TRAINER_THROUGHPUT.holders())
        assert any(h is twin for h in FABRIC_THROUGHPUT.holders())
        assert trainer_monitor._plugin_to_compute_dtype(twin) == torch.float16
        assert fabric_monitor._plugin_to_compute_dtype(twin) == torch.float16


def test_two_true_plugins_one_torn_down_keeps_the_step_hook_for_the_other():
    """torch's global optimizer-step pre-hook is held by each true-precision plugin from ``convert_module`` to
    ``teardown``: one torn down (twice) leaves it in force for the other, whose lr-0 layout step (torch's distributed
    checkpoint's) still creates that plugin's own states."""
    first, second = BF16TruePrecision(), FP16TruePrecision()
    fabric_loop(first, make_data(1), 1)
    _, net, _ = fabric_loop(second, make_data(1), 1)
    assert {id(first), id(second)} <= {id(h) for h in STATE_INIT_HOOK.holders()}
    first.teardown()
    first.teardown()
    holders = [id(h) for h in STATE_INIT_HOOK.holders()]
    assert STATE_INIT_HOOK.made and id(second) in holders and id(first) not in holders
    optimizer = torch.optim.Adam(net.parameters(), lr=0.0)
    optimizer.step()  # no gradients: only the hook creates states
    state = next(iter(optimizer.state.values()))
    assert any(key.startswith("lp.") for key in state), sorted(state)  # the plugin's keys, not Adam's alone
    assert all(torch.isfinite(p).all() for p in net.parameters())
