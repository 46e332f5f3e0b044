"""AmaxHistoryLogger on real fits: ring buffer and delayed scale against a direct computation over the same steps;
what-if fractions against underflow_stats; TE's own state read through a stand-in (tests/te_standin.py)."""

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_precision.callbacks import AmaxHistoryLogger
from lightning_precision.functional import roll_amax_history, underflow_stats
from tests.helpers import HIDDEN, IN, OUT, LitNet, RecordingLogger, TwoOptimizers, loader, make_data, trainer

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def test_roll_amax_history_keeps_the_last_len_steps_like_te():
    history = torch.zeros(3)
    seen = []
    for a in [5.0, 1.0, 2.0, 3.0, 0.5]:
        history[0] = a
        history, amax = roll_amax_history(history, "max")
        seen.append(float(amax))
    # window of 3: max(5), max(5,1), max(5,1,2), max(1,2,3), max(2,3,0.5)
    assert seen == [5.0, 5.0, 5.0, 3.0, 3.0]
    history[0] = 9.0
    assert float(roll_amax_history(history, "most_recent")[1]) == 9.0
    with pytest.raises(ValueError, match="most_recent"):
        roll_amax_history(history, "mean")


class Reference(Callback):
    """Records each layer's input, weight and output-gradient amax independently, and keeps the logging step's
    tensors and the logger's scales, to recompute everything by hand."""

    def __init__(self, logger):
        self.logger, self.amax, self.scales_before, self.tensors = logger, [], [], {}
        self._step = {}

    def setup(self, trainer, pl_module, stage):
        for name, m in pl_module.named_modules():
            if isinstance(m, nn.Linear):
                m.register_forward_hook(self._hook(name))

    def _hook(self, name):
        def hook(module, args, out):
            if not module.training or not torch.is_grad_enabled():
                return
            self._step[name] = {"input": args[0].detach(), "weight": module.weight.detach().clone()}
            out.register_hook(lambda g: self._step[name].__setitem__("grad_output", g.detach()))

        return hook

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        # runs before the logger (callbacks run in order): the scale in effect for this step, not yet rolled
        self.scales_before.append(self.logger.scale.clone())
        self.amax.append({n: {k: float(t.abs().max()) for k, t in d.items()} for n, d in self._step.items()})
        self.tensors = {n: dict(d) for n, d in self._step.items()}


def test_history_and_delayed_scale_equal_a_direct_computation():
    logger = AmaxHistoryLogger(history_len=3, log_every_n_steps=5)
    ref = Reference(logger)
    t = trainer(None, max_steps=5, callbacks=[ref, logger])
    t.fit(LitNet(), loader(make_data(5)))
    layers, tensors = logger.layers, ("input", "weight", "grad_output")
    assert layers == ["net.0", "net.2", "net.4"]
    # the window holds the last 2 completed steps (row 0 is cleared for the next), oldest first
    window = logger.chronological_history()
    expected = torch.tensor([[[ref.amax[s][layer][k] for k in tensors] for layer in layers] for s in (3, 4)])
    torch.testing.assert_close(window, expected)
    # the scale after step 5 comes from the max over the last 3 steps, per tensor, with e4m3/e5m2 maxima
    window3 = torch.tensor([[[ref.amax[s][layer][k] for k in tensors] for layer in layers] for s in (2, 3, 4)])
    expected_scale = torch.tensor([E4M3_MAX, E4M3_MAX, E5M2_MAX]) / window3.amax(dim=0)
    torch.testing.assert_close(logger.scale, expected_scale)
    # logged: the current amax and the scale in effect during the step
    logged = logger.last_metrics
    assert float(logged["precision/amax/weight/net.2"]) == pytest.approx(ref.amax[4]["net.2"]["weight"])
    assert float(logged["precision/fp8_scale/input/net.0"]) == pytest.approx(float(ref.scales_before[4][0, 0]))


def test_what_if_fractions_equal_underflow_stats():
    logger = AmaxHistoryLogger(history_len=4, log_every_n_steps=3, what_if_sample=None)  # every element: exact
    ref = Reference(logger)
    t = trainer(None, max_steps=3, callbacks=[ref, logger])

    class Tiny(LitNet):  # one input feature far below the rest: e4m3 flushes it at the scale the max allows
        def training_step(self, batch, batch_idx):
            x, y = batch
            x = x.clone()
            x[:, 0] = 1e-7
            return super().training_step((x, y), batch_idx)

    t.fit(Tiny(), loader(make_data(3)))
    logged, scales = logger.last_metrics, ref.scales_before[-1]
    for tensor, fmt, fp8_max in [("input", "e4m3fn", E4M3_MAX), ("grad_output", "e5m2", E5M2_MAX)]:
        k = 0 if tensor == "input" else 2
        captured = {n: ref.tensors[n][tensor] for n in logger.layers}
        delayed = sum_stats([underflow_stats(captured[n], fmt, scales[i, k]).total
                             for i, n in enumerate(logger.layers)])
        current = sum_stats([underflow_stats(captured[n], fmt, fp8_max / captured[n].abs().max()).total
                             for n in logger.layers])
        for kind, stats in (("delayed", delayed), ("current", current)):
            key = f"precision/fp8_whatif/{tensor}/{kind}"
            assert float(logged[f"{key}/underflow"]) == pytest.approx(float(stats.underflow_fraction))
            assert float(logged[f"{key}/overflow"]) == pytest.approx(float(stats.overflow_fraction))
    assert float(logged["precision/fp8_whatif/input/current/underflow"]) > 0  # not vacuous
    # Block-scaled what-if: each layer's tensor cast to MXFP8 / NVFP4 (each block at its own scale) by underflow_stats.
    for tensor in ("input", "weight", "grad_output"):
        for fmt in ("mxfp8", "nvfp4"):
            key = f"precision/fp8_whatif/{tensor}/{fmt}"
            direct = sum_stats([underflow_stats(ref.tensors[n][tensor], fmt).total for n in logger.layers])
            assert float(logged[f"{key}/underflow"]) == pytest.approx(float(direct.underflow_fraction))
            assert float(logged[f"{key}/overflow"]) == pytest.approx(float(direct.overflow_fraction))
    # The 1e-7 column shares its blocks with O(1) inputs: both block formats flush it, as the per-tensor cast does.
    assert float(logged["precision/fp8_whatif/input/nvfp4/underflow"]) > 0


def test_what_if_sample_is_evenly_spaced_contiguous_runs():
    from lightning_precision.callbacks.amax import block_sample

    t = torch.arange(10_000.0).reshape(100, 100)
    sample = block_sample(t, 1000, block=100)
    assert sample.numel() == 1000 and sample.is_contiguous()
    runs = sample.view(10, 100)
    assert torch.equal(runs[:, 1] - runs[:, 0], torch.ones(10))  # each run is contiguous in the tensor
    assert runs[0, 0] == 0 and runs[-1, -1] > 9_000  # and the runs span the whole tensor, evenly
    assert block_sample(t, None).numel() == 10_000 and block_sample(t, 50_000).numel() == 10_000


def sum_stats(stats):
    total = stats[0]
    for s in stats[1:]:
        total = total + s
    return total


def test_checkpoint_resume_continues_the_history(tmp_path):
    first = AmaxHistoryLogger(history_len=8)
    t = trainer(None, max_epochs=1, callbacks=[first])
    t.fit(LitNet(), loader(make_data(3)))
    t.save_checkpoint(tmp_path / "a.ckpt")
    resumed = AmaxHistoryLogger(history_len=8)
    trainer(None, max_epochs=2, callbacks=[resumed]).fit(LitNet(), loader(make_data(3)), ckpt_path=tmp_path / "a.ckpt")
    assert resumed.steps == 6
    torch.testing.assert_close(resumed.chronological_history()[:3], first.chronological_history())


def test_a_restored_logger_has_the_scale_and_history_of_the_live_one():
    """Between steps the ring's oldest slot still counts in the scale in effect; a checkpoint that saved it zeroed gave
    a restored logger a window of one step less, so a different scale (silently) right after a resume."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    inputs = [torch.randn(4, 8) * k for k in (1.0, 1.0, 1.0, 50.0, 1.0, 1.0, 1.0, 1.0)]

    def step(logger, net, x):
        logger.capturing(True)
        net(x).sum().backward()
        net.zero_grad()
        logger.end_step(log=False)

    live = AmaxHistoryLogger(history_len=3)
    live.attach(model)
    for x in inputs[:6]:  # the large step is the oldest of the 3-step window now
        step(live, model, x)
    restored = AmaxHistoryLogger(history_len=3)
    restored.load_state_dict(copy.deepcopy(live.state_dict()))
    twin = copy.deepcopy(model)
    restored.attach(twin)
    torch.testing.assert_close(restored.scale, live.scale, rtol=0, atol=0)
    torch.testing.assert_close(restored.history, live.history, rtol=0, atol=0)
    for x in inputs[6:]:  # both go on alike as the large step ages out
        step(live, model, x)
        step(restored, twin, x)
        torch.testing.assert_close(restored.scale, live.scale, rtol=0, atol=0)
        torch.testing.assert_close(restored.chronological_history(), live.chronological_history()[-len(
            restored.chronological_history()):], rtol=0, atol=0)


def test_save_writes_history_and_plot(tmp_path):
    logger = AmaxHistoryLogger(history_len=4, save_dir=str(tmp_path))
    trainer(None, max_steps=3, log_every_n_steps=1, callbacks=[logger]).fit(LitNet(), loader(make_data(3)))
    saved = torch.load(tmp_path / "amax_history.pt", weights_only=False)
    assert saved["layers"] == ["net.0", "net.2", "net.4"] and saved["history"].shape == (3, 3, 3)
    assert (tmp_path / "amax_history.png").stat().st_size > 10_000


def test_reads_transformer_engines_own_delayed_scaling_state(monkeypatch):
    from tests import te_standin

    te = te_standin.install(monkeypatch)
    layer = te.Linear(16, 16, params_dtype=torch.float32, device="cpu")
    layer.fp8_meta["scaling_fwd"].amax_history[0] = torch.tensor([3.0, 0.5, 7.0])  # input, weight, output
    layer.fp8_meta["scaling_bwd"].amax_history[0] = torch.tensor([0.25, 9.0])  # grad_output, grad_input
    layer.fp8_meta["scaling_fwd"].scale[:] = torch.tensor([10.0, 20.0, 30.0])
    layer.fp8_meta["scaling_bwd"].scale[:] = torch.tensor([40.0, 50.0])
    logger = AmaxHistoryLogger(history_len=8)
    logger.attach(nn.Sequential(layer))
    metrics = logger.end_step()
    # TE's (input, weight, grad_output): the forward's input and weight, the backward's grad_output
    assert [float(metrics[f"precision/amax/{t}/0"]) for t in ("input", "weight", "grad_output")] == [3.0, 0.5, 0.25]
    assert [float(metrics[f"precision/fp8_scale/{t}/0"]) for t in ("input", "weight", "grad_output")] == \
        [10.0, 20.0, 40.0]
    # TE's rows land in the ring in TE's order at any ring position (here the copy wraps around its end): after a
    # step, TE's row 0 (the step just done) is the newest completed row, its rows 2.. come before it
    layer.fp8_meta["scaling_fwd"].amax_history[:, 0] = torch.arange(8.0) + 1  # TE's input amax rows: 1, 2, ..., 8
    for _ in range(3):
        logger.end_step(log=False)
    history = logger.history[:, 0, 0]  # the input amax of layer 0, TE's order
    assert history[-1] == 1.0 and torch.equal(history[1:-1], torch.arange(3.0, 9.0))


def test_bad_arguments():
    with pytest.raises(ValueError, match="history_len=0"):
        AmaxHistoryLogger(history_len=0)
    with pytest.raises(ValueError, match="amax_compute_algo='mean'"):
        AmaxHistoryLogger(amax_compute_algo="mean")


def test_writes_to_a_real_logger(tmp_path):
    import csv

    from lightning.pytorch.loggers import CSVLogger

    logger = AmaxHistoryLogger(history_len=4)
    t = trainer(None, max_steps=4, log_every_n_steps=2, logger=CSVLogger(tmp_path, name="run"), callbacks=[logger])
    t.fit(LitNet(), loader(make_data(4)))
    key = "precision/amax/input/net.0"
    rows = [r for r in csv.DictReader(open(t.logger.experiment.metrics_file_path)) if r.get(key)]
    assert [int(r["step"]) for r in rows] == [1, 3]
    assert float(rows[-1][key]) == pytest.approx(logger.last_metrics[key])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"margin": "1"}, r"margin='1'.*whole number"),
        ({"margin": None}, r"margin=None.*whole number"),
        ({"margin": float("nan")}, r"margin=nan.*whole number"),
        ({"margin": -1}, r"margin=-1.*>= 0"),
        ({"history_len": True}, r"history_len=True.*from 1 to 65536"),
        ({"history_len": 10**9}, r"history_len=1000000000.*from 1 to 65536"),
        ({"what_if_sample": 0}, r"what_if_sample=0.*positive number"),
        ({"what_if_sample": -5}, r"what_if_sample=-5.*positive number"),
        ({"what_if_sample": 2.5}, r"what_if_sample=2\.5.*positive number"),
        ({"what_if": "yes"}, r"what_if='yes'.*True or False"),
        ({"save_dir": 3}, r"save_dir=3.*folder path"),
        ({"block_formats": "mxfp8"}, r"block_formats='mxfp8'.*tuple of block-scaled"),
        ({"block_formats": ("e4m3fn",)}, r"block_formats=\('e4m3fn',\).*tuple of block-scaled"),
        ({"block_formats": ("fp7",)}, r"block_formats=\('fp7',\).*tuple of block-scaled"),
    ],
)
def test_more_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AmaxHistoryLogger(**kwargs)


def test_an_unwritable_save_dir_fails_before_the_first_step(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    steps = []

    class Counting(LitNet):
        def training_step(self, batch, batch_idx):
            steps.append(batch_idx)
            return super().training_step(batch, batch_idx)

    with pytest.raises(ValueError, match=r"AmaxHistoryLogger\(save_dir=.*a-file.*not a folder"):
        trainer(None, max_steps=2, callbacks=[AmaxHistoryLogger(save_dir=str(blocker))]).fit(Counting(),
                                                                                          loader(make_data(2)))
    assert steps == []


class WithAttention(LitNet):
    """nn.MultiheadAttention (whose out_proj never runs its forward) and a linear layer the model skips."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.unused = nn.Linear(32, 32)

    def forward(self, x):
        h = self.net[1](self.net[0](x)).unsqueeze(1)
        h = self.attn(h, h, h, need_weights=False)[0].squeeze(1)
        return self.net[4](self.net[3](self.net[2](h)))


def test_layers_that_never_run_are_left_out_of_the_logs_and_the_plot(tmp_path):
    logger = AmaxHistoryLogger(history_len=4, save_dir=str(tmp_path))
    trainer(None, max_steps=2, log_every_n_steps=1, callbacks=[logger]).fit(WithAttention(), loader(make_data(2)))
    assert "attn.out_proj" not in logger.layers  # its weight is used functionally: no hook would ever fire
    logged_layers = {k.rsplit("/", 1)[1] for k in logger.last_metrics if k.startswith("precision/amax/")}
    assert logged_layers == {"net.0", "net.2", "net.4"}  # `unused` never ran: no amax 0 plotted at 1e-30
    assert all(logger.last_metrics[f"precision/amax/weight/{layer}"] > 0 for layer in logged_layers)
    saved = torch.load(tmp_path / "amax_history.pt", weights_only=False)
    assert saved["ran"] == [layer in logged_layers for layer in saved["layers"]]


def _plain_loop(logger, end_after_step: bool, steps: int = 3, model=None):
    """A Fabric-style loop of a small MLP: forward, backward, then `end_step` before or after `optimizer.step()`."""
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    if logger is not None:
        logger.attach(model)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(8, 16, generator=g)).square().mean().backward()
        if logger is not None and not end_after_step:
            logger.end_step(False)
        opt.step()
        opt.zero_grad()
        if logger is not None and end_after_step:
            logger.end_step(False)
    return model


@pytest.mark.parametrize("ops_cheap", [True, False], ids=["cpu-policy", "accelerator-policy"])
def test_the_weights_recorded_are_the_ones_the_step_used_whenever_end_step_comes(ops_cheap, monkeypatch):
    """On an accelerator the weights' amaxes are taken together, inside the backward (at the first output gradient):
    a loop that ends the step after `optimizer.step()` still records the weights its forward used."""
    monkeypatch.setattr("lightning_precision.callbacks.amax.ops_are_cheap", lambda device: ops_cheap)
    before, after = AmaxHistoryLogger(history_len=8), AmaxHistoryLogger(history_len=8)
    _plain_loop(before, end_after_step=False)
    _plain_loop(after, end_after_step=True)
    assert torch.equal(before.chronological_history(), after.chronological_history())
    assert bool((before.chronological_history()[:, :, 1] > 0).all())  # weights recorded every step


@pytest.mark.parametrize("ops_cheap", [True, False], ids=["cpu-policy", "accelerator-policy"])
def test_a_step_that_never_ended_leaves_nothing_behind_a_new_attach(ops_cheap, monkeypatch):
    """A forward whose step was abandoned (an exception before the backward), then `attach` again: the next step's
    record is a fresh logger's (it once recorded the weight as 0: the abandoned forward had marked it seen)."""
    monkeypatch.setattr("lightning_precision.callbacks.amax.ops_are_cheap", lambda device: ops_cheap)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    reused = AmaxHistoryLogger(history_len=8)
    reused.attach(model)
    model(torch.randn(8, 16))  # no backward, no end_step
    _plain_loop(reused, end_after_step=False, steps=2, model=model)
    torch.manual_seed(0)
    fresh = AmaxHistoryLogger(history_len=8)
    _plain_loop(fresh, end_after_step=False, steps=2, model=nn.Sequential(nn.Linear(16, 32), nn.ReLU(),
                                                                        nn.Linear(32, 4)))
    assert torch.equal(reused.chronological_history(), fresh.chronological_history())


def test_a_fit_that_raises_leaves_no_hook_on_the_model():
    class Failing(LitNet):
        def training_step(self, batch, batch_idx):
            self(batch[0])
            raise RuntimeError("boom")

    model = Failing()
    with pytest.raises(RuntimeError, match="boom"):
        trainer(None, max_steps=2, callbacks=[AmaxHistoryLogger()]).fit(model, loader(make_data(2)))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_manual_optimization_with_two_optimizers_is_one_step_a_batch():
    """Two optimizers stepped per batch: one step of the history per batch (not an empty one per extra optimizer),
    logged at the step the module's own `self.log` values are."""
    class Manual(TwoOptimizers):
        def __init__(self):
            torch.manual_seed(0)
            super().__init__(nn.Linear(IN, HIDDEN), nn.Sequential(nn.ReLU(), nn.Linear(HIDDEN, OUT)))

        def loss(self, x, batch_idx):
            loss = self.b(self.a(x)).square().mean()
            self.log("my_loss", loss)
            return loss

    logger, recorder = AmaxHistoryLogger(history_len=8, log_every_n_steps=1, block_formats=()), RecordingLogger()
    trainer(None, max_steps=6, callbacks=[logger], logger=recorder, log_every_n_steps=1).fit(Manual(),
                                                                                           loader(make_data(3)))
    assert logger.steps == 3 and bool((logger.chronological_history().sum(dim=(1, 2)) > 0).all())
    amax_steps = [s for s, m in recorder.logged if "precision/amax/input/a" in m]
    assert amax_steps == [s for s, m in recorder.logged if "my_loss" in m] == [0, 1, 2]


@pytest.mark.parametrize("ops_cheap", [True, False], ids=["cpu-policy", "accelerator-policy"])
def test_a_parametrized_weight_is_not_read_and_the_training_is_unchanged(ops_cheap, monkeypatch):
    """spectral_norm computes its weight at each read, with a power iteration in training mode: reading it would change
    the run. Its weight amax is left out, with a warning; the training equals the one without the logger."""
    from torch.nn.utils.parametrizations import spectral_norm

    monkeypatch.setattr("lightning_precision.callbacks.amax.ops_are_cheap", lambda device: ops_cheap)

    def model():
        torch.manual_seed(0)
        return nn.Sequential(spectral_norm(nn.Linear(16, 32)), nn.ReLU(), nn.Linear(32, 4))

    plain = _plain_loop(None, end_after_step=False, model=model())
    logger = AmaxHistoryLogger(history_len=8, block_formats=())
    with pytest.warns(UserWarning, match="parametrized"):
        watched = _plain_loop(logger, end_after_step=False, model=model())
    for a, b in zip([*plain.parameters(), *plain.buffers()], [*watched.parameters(), *watched.buffers()], strict=True):
        assert torch.equal(a, b)
    history = logger.chronological_history()
    assert bool((history[:, 0, 1] == 0).all()) and bool((history[:, 1, 1] > 0).all())  # its weight only
    assert bool((history[:, 0, 0] > 0).all())  # its input still recorded
