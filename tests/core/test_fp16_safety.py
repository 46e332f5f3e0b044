"""FP16MixedPrecision never writes NaN into good weights, stops a run that skips every step, updates the scale once per
backward, and resumes checkpoints by one documented rule in both directions with Lightning's plugin."""

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_precision import FP16MixedPrecision, SkippedStepsError
from lightning_precision import fabric as lp_fabric
from tests import helpers
from tests.helpers import LitNet, assert_params_equal, count_host_reads, loader, make_data, params, trainer

BIG = 1e6  # fp16 max is 65504: inputs this large make the first layer's output (and the loss) inf


def fabric_run(plugin, batches, seed=0):
    """A Fabric loop over ``batches`` of (x, y); returns the net and the losses."""
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in batches:
        opt.zero_grad()
        fabric.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
    return net


def batches(n_bad, n_good):
    x, y = make_data(1).tensors
    return [(x * BIG, y)] * n_bad + [(x, y)] * n_good


def all_finite(net):
    return all(torch.isfinite(p).all() for p in net.parameters())


def test_a_long_run_of_overflows_cannot_turn_the_next_clean_step_into_nan_weights():
    """torch's GradScaler halves its scale to 2**16 * 2**-150 -> 0 here; 1/0 = inf, and the clean step's unscale
    computes 0 * inf = nan into every weight. Ours stops at min_scale."""
    plugin = lp_fabric.FP16MixedPrecision(max_consecutive_skips=None)
    net = fabric_run(plugin, batches(150, 3))
    assert all_finite(net)
    assert plugin.loss_scale == 2.0**-24  # the floor, not 0
    assert plugin.skipped_steps == 150


def test_skipping_every_step_stops_the_run_with_a_clear_error():
    """60 non-finite steps then 40 clean ones: without the stop, the clean steps would run at the floor scale, where
    fp16 flushes the gradients, and the weights would never change, silently."""
    plugin = lp_fabric.FP16MixedPrecision()
    with pytest.raises(SkippedStepsError, match=r"skipped 50 optimizer steps in a row.*max_consecutive_skips=None"):
        fabric_run(plugin, batches(60, 40))
    assert plugin.skipped_steps == 50


def test_the_streak_resets_on_a_clean_step():
    plugin = lp_fabric.FP16MixedPrecision(max_consecutive_skips=3, init_scale=2.0**10)
    x, y = make_data(1).tensors
    net = fabric_run(plugin, [(x * BIG, y)] * 2 + [(x, y)] + [(x * BIG, y)] * 2 + [(x, y)])
    assert plugin.skipped_steps == 4 and all_finite(net)


def test_fused_optimizers_are_checked_too_without_a_read_every_step(monkeypatch):
    """A fused optimizer unscales inside step(): the host never learns about skips for free, so the streak is read
    from the device once every max_consecutive_skips updates, and on no other step."""
    plugin = lp_fabric.FP16MixedPrecision(max_consecutive_skips=4, skip_schedulers_on_overflow=False)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = nn.Linear(16, 4)
    model, opt = fabric.setup(net, torch.optim.Adam(net.parameters(), fused=True))
    x = torch.full((2, 16), BIG)
    reads, per_iteration = count_host_reads(monkeypatch), []
    with pytest.raises(SkippedStepsError, match="skipped 4 optimizer steps"):
        for _ in range(8):
            reads[0] = 0
            fabric.backward(model(x).sum())  # applies the previous step's update, where the streak is checked
            opt.step()
            opt.zero_grad()
            per_iteration.append(reads[0])
    monkeypatch.undo()
    assert per_iteration == [0, 0, 0, 0]  # the fifth backward applied the fourth update: the one read, then the error


@pytest.mark.parametrize("bad", [0.0, float("nan"), -8.0, float("inf")])
def test_a_checkpoint_with_an_unusable_scale_restarts_it(bad, tmp_path):
    ds = make_data(4)
    first = trainer(FP16MixedPrecision(init_scale=256.0), max_epochs=1)
    first.fit(LitNet(), loader(ds))
    first.save_checkpoint(tmp_path / "c.ckpt")
    checkpoint = torch.load(tmp_path / "c.ckpt", weights_only=False)
    checkpoint["FP16MixedPrecision"]["scale"] = bad
    torch.save(checkpoint, tmp_path / "c.ckpt")

    plugin, model = FP16MixedPrecision(init_scale=256.0), LitNet()
    with pytest.warns(UserWarning, match="loss scale is .*Restarting the scale from init_scale=256"):
        trainer(plugin, max_epochs=2).fit(model, loader(ds), ckpt_path=tmp_path / "c.ckpt")
    assert all_finite(model) and plugin.loss_scale == 256.0


def test_a_checkpoint_scale_outside_the_bounds_is_clamped():
    plugin = lp_fabric.FP16MixedPrecision()
    state = plugin.state_dict()
    with pytest.warns(UserWarning, match=r"outside \[min_scale, max_scale\].*clamped to 1.67772e\+07"):
        plugin.load_state_dict({**state, "scale": 2.0**40})
    assert plugin.loss_scale == 2.0**24


# ---- several optimizers after one backward ---------------------------------------------------------------------------


def two_nets():
    torch.manual_seed(0)
    return nn.Linear(8, 4), nn.Linear(8, 4)


def two_loss(a, b, x):
    # `a` overflows in fp16 (its input is cast to inf), `b` is clean: a's step is skipped, b's is taken.
    return a(x * BIG).sum() + b(x).sum()


def hand_written_two_optimizers(steps):
    """torch's documented pattern: one scaled backward, step each optimizer, then one update."""
    a, b = two_nets()
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for x in steps:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = two_loss(a, b, x)
        scaler.scale(loss).backward()
        scaler.step(opt_a)
        scaler.step(opt_b)
        scaler.update()
        opt_a.zero_grad()
        opt_b.zero_grad()
    return a, b, scaler.get_scale()


STEPS = [torch.ones(2, 8), torch.ones(2, 8) * 0.5, torch.ones(2, 8) * 2]


@pytest.mark.parametrize("read_between", [False, True], ids=["plain", "scale read between the two steps"])
def test_fabric_updates_the_scale_once_per_backward(read_between):
    """Also when the scale is read between the two steps (logging after the first): the read applies the update, and
    the second optimizer must still be unscaled with the scale its gradients carry (it got 2x its update)."""
    expected_a, expected_b, expected_scale = hand_written_two_optimizers(STEPS)
    plugin = lp_fabric.FP16MixedPrecision(init_scale=1024.0)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    a, b = two_nets()
    (ma, opt_a), (mb, opt_b) = fabric.setup(a, torch.optim.SGD(a.parameters(), lr=0.1)), fabric.setup(
        b, torch.optim.SGD(b.parameters(), lr=0.1))
    for x in STEPS:
        fabric.backward(two_loss(ma, mb, x))
        opt_a.step()
        if read_between:
            plugin.metrics(), plugin.loss_scale, plugin.skipped_steps
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
    assert_params_equal(params(b), params(expected_b))  # b's update is the true gradient's, not twice it
    assert_params_equal(params(a), params(expected_a))
    assert plugin.loss_scale == expected_scale == 1024.0 * 0.5**3
    assert plugin.skipped_steps == 3


class TwoOptimizers(helpers.TwoOptimizers):
    def __init__(self):
        super().__init__(*two_nets())

    def loss(self, x, batch_idx):
        return two_loss(self.a, self.b, x)


def test_trainer_manual_optimization_updates_the_scale_once_per_training_step():
    expected_a, expected_b, expected_scale = hand_written_two_optimizers(STEPS)
    plugin, model = FP16MixedPrecision(init_scale=1024.0), TwoOptimizers()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.stack(STEPS)), batch_size=None)
    trainer(plugin, max_steps=2 * len(STEPS)).fit(model, data)  # the Trainer counts each optimizer's step
    assert_params_equal(params(model.b), params(expected_b))
    assert_params_equal(params(model.a), params(expected_a))
    assert plugin.loss_scale == expected_scale


# ---- resuming ----------------------------------------------------------------------------------------------------------


def test_resuming_with_other_arguments_keeps_yours_and_says_so(tmp_path):
    first = lp_fabric.FP16MixedPrecision(init_scale=256.0, growth_interval=2)
    fabric_run(first, batches(1, 3))
    saved = first.state_dict()
    other = lp_fabric.FP16MixedPrecision(init_scale=256.0, growth_interval=1000, backoff_factor=0.25)
    with pytest.warns(UserWarning, match=r"backoff_factor: checkpoint 0.5, now 0.25; growth_interval: checkpoint 2, now 1000.*arguments you pass"):
        other.load_state_dict(saved)
    assert other.scaler.get_growth_interval() == other.scaler_config.growth_interval == 1000
    assert other.scaler.get_backoff_factor() == other.scaler_config.backoff_factor == 0.25
    assert other.loss_scale == first.loss_scale and other.skipped_steps == first.skipped_steps == 1


def test_resuming_with_a_smaller_growth_interval_still_grows_the_scale():
    """A growth tracker saved under growth_interval=1000 (here at 5 clean steps) passes a new interval of 2: torch grows
    only when the tracker reaches the interval exactly, so the scale would never grow again. It grows on the next
    clean step instead."""
    first = lp_fabric.FP16MixedPrecision(init_scale=256.0, growth_interval=1000)
    fabric_run(first, batches(0, 5))
    saved = first.state_dict()
    assert int(saved["_growth_tracker"]) == 5 and first.loss_scale == 256.0
    other = lp_fabric.FP16MixedPrecision(init_scale=256.0, growth_interval=2)
    with pytest.warns(UserWarning, match=r"growth_interval: checkpoint 1000, now 2"):
        other.load_state_dict(saved)
    fabric_run(other, batches(0, 3))
    assert other.loss_scale == 1024.0  # grew on the first clean step, then again two steps later


def test_lightnings_plugin_resumes_our_checkpoint_with_its_scale(tmp_path):
    """The docs promise both directions; Lightning looks for its state under "MixedPrecision"."""
    ds = make_data(4, overflow_batches=(1,))
    config = dict(init_scale=256.0, growth_interval=3)
    first = trainer(FP16MixedPrecision(**config), max_epochs=1)
    first.fit(LitNet(), loader(ds))
    first.save_checkpoint(tmp_path / "ours.ckpt")

    lightning_plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16))
    resumed = LitNet()
    trainer(lightning_plugin, max_epochs=2).fit(resumed, loader(ds), ckpt_path=tmp_path / "ours.ckpt")

    straight_plugin, straight = FP16MixedPrecision(**config), LitNet()
    trainer(straight_plugin, max_epochs=2).fit(straight, loader(ds))
    assert lightning_plugin.scaler.get_scale() == straight_plugin.loss_scale != 2.0**16
    assert_params_equal(params(resumed), params(straight))
    assert math.isfinite(lightning_plugin.scaler.get_scale())


def test_the_scaler_overrides_one_private_method_of_torchs():
    """Whether a step ran is seen through the optimizer's public step post-hook, not by overriding
    ``GradScaler._maybe_opt_step``; the one private override is ``_unscale_grads_``, torch's single place of the
    gradient check, whose kernel refuses bf16 on CUDA (its canary: tests/upstream/test_upstream_torch.py). This fails if
    another private override comes in."""
    from lightning_precision._core.scaling.scaler import TrackingGradScaler

    overridden = {name for name in vars(TrackingGradScaler) if name.startswith("_") and not name.startswith("__")
                  and hasattr(torch.amp.GradScaler, name)}
    assert overridden == {"_unscale_grads_"}


# ---- checkpoints that no scaler saved --------------------------------------------------------------------------------


def _saved_state():
    plugin = lp_fabric.FP16MixedPrecision(init_scale=256.0)
    fabric_run(plugin, batches(1, 2))
    return plugin.state_dict()


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"scale": "big"}, r"has scale='big', which is not a number"),
        ({"scale": None}, r"has scale=None, which is not a number"),
        ({"scale": [256.0]}, r"has scale=\[256\.0\], which is not a number"),
        ({"scale": ...}, r"lacks 'scale' \(it holds \["),
        ({"_growth_tracker": ...}, r"lacks '_growth_tracker'"),
        ({"_growth_tracker": -1}, r"has _growth_tracker=-1, which is not a count of steps \(an int >= 0\)"),
        ({"skipped_steps": -1}, r"has skipped_steps=-1, which is not a count"),
        ({"optimizer_steps": 2.5}, r"has optimizer_steps=2\.5, which is not a count"),
        ({"consecutive_skips": -3}, r"has consecutive_skips=-3, which is not a count"),
        ({"skipped_steps": "1"}, r"has skipped_steps='1', which is not a count"),
    ],
)
def test_a_scaler_state_no_scaler_saved_is_refused_naming_key_value_and_fix(edit, match):
    """Before, each of these loaded silently (negative counters, made-up trackers), or failed inside torch with a raw
    KeyError / TypeError naming nothing."""
    state = _saved_state()
    for key, value in edit.items():
        if value is ...:
            del state[key]
        else:
            state[key] = value
    plugin = lp_fabric.FP16MixedPrecision(init_scale=256.0)
    fix = r".*delete the plugin's entry \(`checkpoint\['FP16MixedPrecision'\]`"
    with pytest.raises(ValueError, match=r"^`FP16MixedPrecision.load_state_dict`: the checkpoint's scaler state " + match + fix):
        plugin.load_state_dict(state)


def test_a_trainer_checkpoint_with_a_non_numeric_scale_stops_the_resume_with_the_fix(tmp_path):
    ds = make_data(2)
    first = trainer(FP16MixedPrecision(init_scale=256.0), max_epochs=1)
    first.fit(LitNet(), loader(ds))
    first.save_checkpoint(tmp_path / "c.ckpt")
    checkpoint = torch.load(tmp_path / "c.ckpt", weights_only=False)
    checkpoint["FP16MixedPrecision"]["scale"] = "65536"
    torch.save(checkpoint, tmp_path / "c.ckpt")
    with pytest.raises(ValueError, match=r"scale='65536', which is not a number.*checkpoint\['FP16MixedPrecision'\]"):
        trainer(FP16MixedPrecision(init_scale=256.0), max_epochs=2).fit(LitNet(), loader(ds), ckpt_path=tmp_path / "c.ckpt")


def test_a_streak_saved_above_the_new_limit_restarts_with_a_warning_instead_of_stopping_at_the_first_skip():
    """6 skipped steps in a row saved under no limit, resumed with max_consecutive_skips=3: taken as is, the first
    skipped step after the resume (a streak of 7) stopped the run."""
    saved = lp_fabric.FP16MixedPrecision(init_scale=2.0**10, max_consecutive_skips=None)
    fabric_run(saved, batches(0, 1) + batches(6, 0))
    state = saved.state_dict()
    assert state["consecutive_skips"] == 6
    resumed = lp_fabric.FP16MixedPrecision(init_scale=2.0**10, max_consecutive_skips=3)
    with pytest.warns(UserWarning, match=r"consecutive_skips=6 is at or above max_consecutive_skips=3.*restarts from 0"):
        resumed.load_state_dict(state)
    net = fabric_run(resumed, batches(2, 1))  # two more skips: under the new limit of 3 in a row
    assert all_finite(net) and resumed.skipped_steps == 8
    with pytest.raises(SkippedStepsError, match="skipped 3 optimizer steps in a row"):
        fabric_run(resumed, batches(4, 0))  # the limit still holds from the restart on
