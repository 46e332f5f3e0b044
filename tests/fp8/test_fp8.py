"""FP8Precision with the real torchao, emulated on CPU (emulate=True runs torchao's fp8 numerics without fp8
hardware), on real Trainer and Fabric fits."""

import json

import lightning as L
import pytest
import torch
from torch import nn

torchao = pytest.importorskip("torchao", reason="the torchao backend needs `pip install 'lightning-precision[fp8]'`")
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from lightning_precision import FP8Precision, NoEffectWarning  # noqa: E402
from lightning_precision import fabric as lp_fabric  # noqa: E402
from lightning_precision.fp8 import check_fp8_hardware, select_fp8_layers  # noqa: E402
from tests.distributed import fit_spawned  # noqa: E402
from tests.helpers import assert_params_equal, params, trainer  # noqa: E402

STEPS = 12


def fp8_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))


def fp8_data(n_batches=STEPS, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_batches * 8, 32, generator=g)
    y = (x @ torch.randn(32, 16, generator=g)).argmax(dim=1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


class FP8Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = fp8_net()
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def hand_loop(recipe="tensorwise", steps=STEPS):
    import dataclasses

    net = fp8_net()
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(net, config=config, module_filter_fn=lambda m, fqn: fqn == "2")
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in fp8_data(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(net(x), y)
        losses.append(float(loss))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses, net


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_trainer_matches_a_hand_written_torchao_loop(recipe):
    try:
        expected_losses, expected_net = hand_loop(recipe)
    except AssertionError as err:  # the reference itself: plain torchao under CPU autocast
        pytest.skip(f"torchao {torchao.__version__} cannot emulate the {recipe} recipe under CPU autocast itself ({err})")
    plugin, model = FP8Precision(recipe=recipe, emulate=True, skip_small_layers=False), FP8Net()
    trainer(plugin, max_steps=STEPS).fit(model, fp8_data())
    assert isinstance(model.net[2], Float8Linear)  # the middle layer runs in fp8,
    assert type(model.net[0]) is nn.Linear and type(model.net[4]) is nn.Linear  # first and last do not
    torch.testing.assert_close(model.losses, expected_losses)
    assert_params_equal(params(model.net), params(expected_net))


def test_fabric_matches_a_hand_written_torchao_loop():
    expected_losses, expected_net = hand_loop()
    plugin = lp_fabric.FP8Precision(emulate=True, skip_small_layers=False)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = fp8_net()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    losses = []
    for x, y in fp8_data():
        loss = nn.functional.cross_entropy(model(x), y)
        losses.append(float(loss))
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
    assert isinstance(net[2], Float8Linear)
    torch.testing.assert_close(losses, expected_losses)
    assert_params_equal(params(net), params(expected_net))


def test_resume_equals_uninterrupted(tmp_path):
    def plugin():
        return FP8Precision(emulate=True, skip_small_layers=False)

    straight = FP8Net()
    trainer(plugin(), max_epochs=2).fit(straight, fp8_data(4))
    first = trainer(plugin(), max_epochs=1)
    first.fit(FP8Net(), fp8_data(4))
    first.save_checkpoint(tmp_path / "fp8.ckpt")
    resumed = FP8Net()
    trainer(plugin(), max_epochs=2).fit(resumed, fp8_data(4), ckpt_path=tmp_path / "fp8.ckpt")
    assert_params_equal(params(resumed), params(straight))


def test_layer_selection_rules_and_summary():
    model = nn.Sequential(
        nn.Linear(4096, 8192),  # first: kept high
        nn.Linear(8192, 8192),  # large: fp8
        nn.Linear(8192, 1000),  # 1000 not divisible by 16
        nn.Linear(1000, 512),
        nn.Linear(512, 512),  # small for tensorwise: K <= 4096 and N <= 1024
        nn.Linear(512, 10),  # last (and not divisible)
    ).to("meta")
    decisions = {d.fqn: d for d in select_fp8_layers(model, "tensorwise")}
    assert [k for k, d in decisions.items() if d.fp8] == ["1"]
    assert decisions["0"].reason.startswith("first linear layer")
    assert "not divisible by 16" in decisions["2"].reason and "not divisible by 16" in decisions["5"].reason
    assert "too small" in decisions["4"].reason
    # rowwise has stricter thresholds: 8192x8192 still gains, 4096->8192 (first) is excluded anyway
    assert [d.fqn for d in select_fp8_layers(model, "rowwise") if d.fp8] == ["1"]
    # a user filter decides alone, except for the hardware rule
    chosen = select_fp8_layers(model, module_filter=lambda m, fqn: True)
    assert [d.fqn for d in chosen if d.fp8] == ["0", "1", "4"]


def _encoder():
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), num_layers=2,
                                 enable_nested_tensor=False)


@pytest.mark.parametrize("framed", [True, False], ids=["input-encoder-head", "encoder-head"])
def test_first_and_last_are_chosen_among_the_layers_that_run(framed):
    """In a TransformerEncoder the first nn.Linear registered is an attention's out_proj, which never runs as a module:
    the rule passes over it and keeps the first layer that runs (the input projection, or the first feed-forward)."""
    model = (nn.Sequential(nn.Linear(32, 64), _encoder(), nn.Linear(64, 16)) if framed
             else nn.Sequential(_encoder(), nn.Linear(64, 16))).to("meta")
    enc, head = ("1", "2") if framed else ("0", "1")
    first = "0" if framed else f"{enc}.layers.0.linear1"
    high = {d.fqn: d.reason for d in select_fp8_layers(model, skip_small_layers=False) if not d.fp8}
    out_projs = {f"{enc}.layers.{i}.self_attn.out_proj" for i in (0, 1)}
    assert set(high) == {first, head} | out_projs
    assert high[first].startswith("first linear layer") and high[head].startswith("last linear layer")
    assert all("MultiheadAttention" in high[fqn] for fqn in out_projs)


def test_no_fp8_layer_warns_and_the_plugin_keeps_a_summary():
    from lightning_precision.fp8._selection import format_summary

    model, plugin = FP8Net(), FP8Precision(emulate=True)
    with pytest.warns(NoEffectWarning, match="no linear layer runs in fp8.*too small"):
        trainer(plugin, max_steps=1).fit(model, fp8_data(1))
    assert type(model.net[2]) is nn.Linear
    assert [(d.fqn, d.fp8) for d in plugin.layer_decisions] == [("net.0", False), ("net.2", False), ("net.4", False)]
    summary = format_summary(plugin.layer_decisions)
    assert summary.startswith("fp8: 0 of 3 linear layers") and "too small to gain (64x64" in summary


def test_hardware_errors_say_what_was_found_and_how_to_emulate(monkeypatch):
    with pytest.raises(RuntimeError, match=r"compute capability >= 8\.9.*'cpu'.*emulate=True"):
        check_fp8_hardware("cpu", "torchao", "tensorwise", emulate=False)
    # No CUDA device here: torch.cuda's answers are stubbed to an A100's (8.0).
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(RuntimeError, match=r"A100.*8\.0.*BF16MixedPrecision"):
        check_fp8_hardware("cuda", "torchao", "tensorwise", emulate=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    check_fp8_hardware("cuda", "torchao", "tensorwise", emulate=False)  # H100: fine
    with pytest.raises(RuntimeError, match=r"\(mxfp8\) needs CUDA compute capability >= 10\.0"):
        check_fp8_hardware("cuda", "transformer_engine", "mxfp8", emulate=False)


def test_fit_without_emulation_on_cpu_fails_clearly():
    with pytest.raises(RuntimeError, match="emulate=True"):
        trainer(FP8Precision(skip_small_layers=False), max_steps=1).fit(FP8Net(), fp8_data(1))


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"backend='tensorrt'"):
        FP8Precision(backend="tensorrt")
    with pytest.raises(ValueError, match=r"recipe='delayed'.*tensorwise"):
        FP8Precision(recipe="delayed")  # a TE recipe name on the torchao backend
    with pytest.raises(ValueError, match=r"compute_dtype=torch.float32"):
        FP8Precision(compute_dtype=torch.float32)


class RankReport(FP8Net):
    def __init__(self, out_dir):
        super().__init__()
        self.out_dir = out_dir

    def on_train_end(self):
        with open(f"{self.out_dir}/rank{self.global_rank}.json", "w") as f:
            json.dump({"fp8": type(self.net[2]).__name__, "w": [p.double().sum().item() for p in self.parameters()]}, f)


def _middle_only(module, fqn):
    return fqn == "net.2"


def test_ddp_gloo_two_processes_with_emulation(tmp_path):
    plugin = FP8Precision(emulate=True, module_filter=_middle_only)  # a named function: ddp_spawn pickles it
    reports = fit_spawned(trainer(plugin, strategy="ddp_spawn", devices=2, max_steps=3), RankReport(str(tmp_path)),
                          fp8_data(6), tmp_path)
    assert reports[0]["fp8"] == reports[1]["fp8"] == "Float8Linear"
    assert reports[0]["w"] == reports[1]["w"]


class EvalNet(FP8Net):
    """Records, in each evaluation step, whether the loop ran it under inference mode."""

    def __init__(self):
        super().__init__()
        self.inference_mode_seen = []

    def _eval(self, batch):
        self.inference_mode_seen.append(torch.is_inference_mode_enabled())
        x, y = batch
        return self.net(x)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", nn.functional.cross_entropy(self._eval(batch).float(), batch[1]))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", nn.functional.cross_entropy(self._eval(batch).float(), batch[1]))

    def predict_step(self, batch, batch_idx):
        return self._eval(batch)


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_evaluation_after_fit_runs_the_fp8_layers_under_inference_mode(stage):
    """Lightning evaluates under torch.inference_mode by default, where torchao's float8 tensors fail
    (aten.to.dtype); each fp8 layer leaves it for its own forward, so evaluation runs the same fp8 numerics."""
    model = EvalNet()
    t = trainer(FP8Precision(emulate=True, skip_small_layers=False), max_steps=2)
    t.fit(model, fp8_data(2))
    assert isinstance(model.net[2], Float8Linear)
    result = getattr(t, stage)(model, dataloaders=fp8_data(2))
    assert model.inference_mode_seen and all(model.inference_mode_seen)  # the loop really used inference mode
    if stage == "predict":
        x, _ = next(iter(fp8_data(2)))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            expected = model.net(x)
        torch.testing.assert_close(result[0], expected)
    else:
        assert all(torch.isfinite(torch.tensor(list(r.values()))).all() for r in result)
    assert not torch.is_inference_mode_enabled()


class Aliased(L.LightningModule):
    """One nn.Linear registered twice in one parent and once in another."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.out = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 16)
        self.again = self.mid
        self.block = nn.ModuleDict({"shared": self.mid})

    def forward(self, x):
        return self.out(self.block["shared"](self.again(self.mid(self.inp(x)).relu()).relu()).relu())

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_layer_under_several_names_is_converted_once_under_all_of_them():
    model, plugin = Aliased(), FP8Precision(emulate=True, skip_small_layers=False)
    trainer(plugin, max_steps=2).fit(model, fp8_data(2))
    assert isinstance(model.mid, Float8Linear)
    assert model.again is model.mid and model.block["shared"] is model.mid  # identity kept: one module
    [decision] = [d for d in plugin.layer_decisions if d.fp8]
    assert (decision.fqn, decision.aliases) == ("mid", ("again", "block.shared"))


class Attention(L.LightningModule):
    """nn.MultiheadAttention (out_proj used functionally), and a projection whose weight a custom op uses directly."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(32, 64)
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True)
        self.tied = nn.Linear(64, 64)  # its weight is used through F.linear below: its forward never runs
        self.head = nn.Linear(64, 16)

    def forward(self, x):
        h = self.inp(x).unsqueeze(1)
        h = self.attn(h, h, h, need_weights=False)[0].squeeze(1)
        return self.head(nn.functional.linear(h, self.tied.weight).relu())

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_only_layers_that_really_run_are_reported_as_fp8():
    model = Attention()
    plugin = FP8Precision(emulate=True, skip_small_layers=False, skip_first_last=False)
    calls = {}
    with pytest.warns(NoEffectWarning, match=r"did not run their forward.*tied"):
        t = trainer(plugin, max_steps=1)
        t.fit(model, fp8_data(1))
    decisions = {d.fqn: d for d in plugin.layer_decisions}
    assert not decisions["attn.out_proj"].fp8 and "MultiheadAttention" in decisions["attn.out_proj"].reason
    assert not decisions["tied"].fp8 and "did not run" in decisions["tied"].reason
    # every layer still reported as fp8 runs its forward, in fp8
    for fqn in (d.fqn for d in plugin.layer_decisions if d.fp8):
        module = model.get_submodule(fqn)
        assert isinstance(module, Float8Linear)
        module.register_forward_hook(lambda m, a, o, fqn=fqn: calls.__setitem__(fqn, calls.get(fqn, 0) + 1))
    t2 = trainer(plugin, max_steps=1)
    t2.fit(model, fp8_data(1))
    assert set(calls) == {d.fqn for d in plugin.layer_decisions if d.fp8} == {"inp", "head"}


def test_module_filter_with_the_wrong_arity_fails_at_construction():
    with pytest.raises(ValueError, match=r"module_filter=.*module_filter\(module, fqn\).*two arguments"):
        FP8Precision(emulate=True, module_filter=lambda m: True)
    with pytest.raises(ValueError, match=r"module_filter=3.*callable"):
        FP8Precision(emulate=True, module_filter=3)
    FP8Precision(emulate=True, module_filter=lambda module, fqn, *rest: True)  # compatible signatures pass


def test_compiled_fp8_layers_do_not_break_the_graph_and_evaluate_under_inference_mode():
    """The inference-mode hooks on each fp8 layer read the mode, which is a graph break for torch.compile: a compiled
    fp8 model was split at every fp8 layer in training (3 breaks for the 3 layers here). Compiled with gradients on
    they now do nothing; evaluation under inference mode still leaves it per layer (torch 2.7's AOT graph cannot run
    torchao's casts there) and gives the eager result."""
    import torch._dynamo

    from lightning_precision.fp8._torchao import run_outside_inference_mode as _run_outside_inference_mode

    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    import dataclasses

    convert_to_float8_training(net, config=dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"),
                                                               emulate=True))
    for layer in net:
        if isinstance(layer, Float8Linear):
            _run_outside_inference_mode(layer)

    def forward(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return net(x)

    x = torch.randn(16, 64)
    torch._dynamo.reset()
    assert torch._dynamo.explain(forward)(x).graph_break_count == 0
    compiled = torch.compile(forward, backend="aot_eager")
    with torch.inference_mode():
        expected = forward(x)  # eager: the hooks leave inference mode for each fp8 layer
        torch.testing.assert_close(compiled(x), expected)
    torch._dynamo.reset()


def test_a_post_hook_without_its_pre_hook_does_nothing():
    """Under torch.compile the pre-hook may be traced (standing aside) while the post-hook runs eagerly: the post-hook
    must not fail on an empty stack, in a thread that never pushed. (fp8 linear layers do not nest, so at a post-hook
    the stack never holds another layer's entry.)"""
    import threading

    from lightning_precision.fp8._torchao import restore_inference_mode as _restore_inference_mode

    errors = []

    def run():
        try:
            _restore_inference_mode(nn.Linear(2, 2), (), None)
        except Exception as err:  # noqa: BLE001 - the test reports any
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert errors == []


def test_the_fabric_package_imports_nothing_of_lightning_pytorch():
    """``lightning_precision.fabric`` is for Fabric users: no module of it imports ``lightning.pytorch`` (the Trainer's
    knowledge, such as whether FSDP2 will shard the model, lives in the Trainer plugins)."""
    import ast
    from pathlib import Path

    import lightning_precision.fabric

    found = []
    for path in Path(lightning_precision.fabric.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}:{node.lineno} {n}" for n in names if n.startswith(("lightning.pytorch", "pytorch_lightning"))]
    assert not found, found
