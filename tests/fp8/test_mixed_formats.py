"""One model, several fp8 formats side by side: a plan names each layer's format (tensorwise, rowwise,
rowwise_with_gw_hp, MXFP8 under torchao, emulated on CPU with the real torchao layers), and FP8Precision converts each
layer in its own format, under the real Trainer and Fabric. Transformer Engine cannot be installed here (it needs CUDA):
its mixed-format error runs against the stand-in of tests/te_standin.py."""

import lightning as L
import pytest
import torch
from torch import nn

pytest.importorskip("torchao", reason="the torchao backend needs `pip install 'lightning-precision[fp8]'`")
from lightning_precision import FP8Precision, NoEffectWarning  # noqa: E402
from lightning_precision import fabric as lp_fabric  # noqa: E402
from lightning_precision.fp8 import LayerDecision, LayerPlan, PrecisionPlan, _torchao, convert_with_torchao  # noqa: E402
from lightning_precision.fp8._selection import LADDER, TE_CANDIDATES, TORCHAO_CANDIDATES, format_summary  # noqa: E402
from tests import te_standin  # noqa: E402
from tests.helpers import Classifier, has_mxfp8, rowwise_emulates_on_cpu, trainer  # noqa: E402

pytestmark = pytest.mark.skipif(not (has_mxfp8() and rowwise_emulates_on_cpu()),
                                reason="this torchao cannot emulate rowwise under CPU autocast or has no MXFP8 layer")


STEPS, BATCHES, ROWS, WIDTH = 16, 4, 32, 64  # MXFP8's backward casts the tokens in blocks of 32
# Layer path -> the plan's precision: "fp8" is the plugin's recipe (tensorwise), the others each their own format.
FORMATS = {"0": "bf16", "2": "fp8", "4": "rowwise", "6": "rowwise_with_gw_hp", "8": "mxfp8", "10": "bf16"}
RUNS_IN = {"2": "tensorwise", "4": "rowwise", "6": "rowwise_with_gw_hp", "8": "mxfp8"}


def net_of(seed=0):
    torch.manual_seed(seed)
    layers = [nn.Linear(32, WIDTH)]
    for _ in range(4):
        layers += [nn.ReLU(), nn.Linear(WIDTH, WIDTH)]
    return nn.Sequential(*layers, nn.ReLU(), nn.Linear(WIDTH, 16))


def data(batches=BATCHES, rows=ROWS):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batches * rows, 32, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :16].argmax(dim=1)), batch_size=rows)


def optimizer(module):
    return torch.optim.Adam(module.parameters(), lr=1e-2)


def plan(prefix=""):
    """The plan of ``net_of()``'s layers; ``prefix``: the path of that net in the model trained (``"net."``)."""
    return PrecisionPlan(tuple(LayerPlan(prefix + fqn, precision, f"by hand: {precision}")
                               for fqn, precision in FORMATS.items()))


def format_of_layer(layer):
    """The torchao format a converted layer computes in, read from the layer itself (None: a plain nn.Linear)."""
    if getattr(layer, _torchao.MXFP8_FLAG, False):
        return "mxfp8"
    if type(layer) is nn.Linear:
        return None
    return _torchao.torchao_format_name(layer.config)


def assert_formats(net):
    for fqn in FORMATS:
        assert format_of_layer(net.get_submodule(fqn)) == RUNS_IN.get(fqn), fqn


def assert_decisions(plugin, prefix=""):
    decisions = {d.fqn.removeprefix(prefix): d for d in plugin.layer_decisions}
    assert {fqn for fqn, d in decisions.items() if d.fp8} == set(RUNS_IN)
    # "fp8" (the plugin's recipe) has no format of its own; the other layers name theirs.
    assert {fqn: d.format for fqn, d in decisions.items() if d.fp8} == {
        "2": None, "4": "rowwise", "6": "rowwise_with_gw_hp", "8": "mxfp8"}


class Net(Classifier):
    def __init__(self):
        super().__init__(net_of(), optimizer, log_plugin=True)


def decreasing(losses):
    """Finite, and the last epoch's mean loss clearly under the first's."""
    first, last = sum(losses[:BATCHES]) / BATCHES, sum(losses[-BATCHES:]) / BATCHES
    return bool(torch.isfinite(torch.tensor(losses)).all()) and last < first - 0.05


# ---- the names every helper uses ------------------------------------------------------------------------------------


def test_candidate_names_and_ladder():
    assert TORCHAO_CANDIDATES == ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")
    assert TE_CANDIDATES == ("delayed", "current", "mxfp8", "block", "nvfp4")
    assert LADDER == ("nvfp4", "mxfp8", "fp8")


# ---- the conversion, without a plan ---------------------------------------------------------------------------------


def test_convert_with_torchao_puts_each_layer_in_its_own_format():
    net = net_of()
    params = {name: p for name, p in net.named_parameters()}
    decisions = [LayerDecision(fqn, m.in_features, m.out_features, fqn in RUNS_IN, "test",
                               format=None if RUNS_IN.get(fqn) in (None, "tensorwise") else RUNS_IN[fqn])
                 for fqn, m in net.named_modules() if isinstance(m, nn.Linear)]
    net = convert_with_torchao(net, _torchao.torchao_config("tensorwise", emulate=True), decisions)
    assert_formats(net)
    assert all(p is params[name] for name, p in net.named_parameters())  # same Parameters: an optimizer keeps them
    x = torch.randn(ROWS, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        net(x).float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in net.parameters())
    summary = format_summary(decisions)
    assert "4 of 6 linear layers run in fp8 (fp8 1, rowwise 1, rowwise_with_gw_hp 1, mxfp8 1)" in summary
    assert " rowwise_with_gw_hp  test" in summary and " mxfp8               test" in summary


def test_layer_config_keeps_the_plugins_emulation_and_its_own_recipe():
    plugin_config = _torchao.torchao_config("rowwise", emulate=True)
    assert _torchao.layer_config(plugin_config, None) is plugin_config
    assert _torchao.torchao_format_name(_torchao.layer_config(plugin_config, "tensorwise")) == "tensorwise"
    assert _torchao.layer_config(plugin_config, "tensorwise").emulate
    assert _torchao.layer_config(plugin_config, "mxfp8") == _torchao.MXFP8Recipe(emulate=True)
    with pytest.raises(ValueError, match="'delayed' is not a torchao format"):
        _torchao.layer_config(plugin_config, "delayed")


# ---- the plugin, with a plan naming formats -------------------------------------------------------------------------


def test_trainer_trains_mixed_formats_and_resumes_them(tmp_path):
    model = Net()
    plugin = FP8Precision(emulate=True, layers=plan("net."))
    t = trainer(plugin, max_steps=STEPS, enable_checkpointing=True, default_root_dir=tmp_path)
    t.fit(model, data())
    assert_formats(model.net)
    assert_decisions(plugin, "net.")
    assert decreasing(model.losses), model.losses
    metrics = plugin.metrics()
    assert metrics["precision/fp8_layers"] == 4
    assert {k: float(v) for k, v in metrics.items() if k.startswith("precision/fp8_layers/")} == {
        "precision/fp8_layers/tensorwise": 1.0, "precision/fp8_layers/rowwise": 1.0,
        "precision/fp8_layers/rowwise_with_gw_hp": 1.0, "precision/fp8_layers/mxfp8": 1.0}
    assert "precision/fp8_layers/mxfp8" in t.callback_metrics  # logged through the Trainer
    ckpt = t.checkpoint_callback.best_model_path
    saved = torch.load(ckpt, weights_only=False)["FP8Precision"]["plan"]
    assert {layer["fqn"].removeprefix("net."): layer["precision"] for layer in saved["layers"]} == FORMATS

    # Resumed (the same plan given, as the docs say): every layer in its format again, and it trains on.
    resumed, again = Net(), FP8Precision(emulate=True, layers=plan("net."))
    t = trainer(again, max_steps=STEPS + 4)
    t.fit(resumed, data(), ckpt_path=ckpt)
    assert_formats(resumed.net)
    assert_decisions(again, "net.")
    assert again.plan == plugin.plan
    assert all(torch.isfinite(torch.tensor(resumed.losses))) and len(resumed.losses) == 4


def test_fabric_trains_mixed_formats_from_a_plan_file_and_resumes_them(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("version: 1\nrecipe: tensorwise\nlayers:\n" + "".join(
        f"  - fqn: '{fqn}'\n    precision: {precision}\n    reason: written by hand\n"
        for fqn, precision in FORMATS.items()))
    plugin = lp_fabric.FP8Precision(emulate=True, layers=str(path))
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = net_of()
    model, opt = fabric.setup(net, optimizer(net))
    losses = []
    for _ in range(STEPS // BATCHES):
        for x, y in data():
            loss = nn.functional.cross_entropy(model(x), y)
            losses.append(float(loss.detach()))
            opt.zero_grad()
            fabric.backward(loss)
            opt.step()
    assert_formats(net)
    assert_decisions(plugin)
    assert decreasing(losses), losses
    table = format_summary(plugin.layer_decisions)
    assert "(fp8 1, rowwise 1, rowwise_with_gw_hp 1, mxfp8 1)" in table
    assert {d.fqn: d.reason for d in plugin.layer_decisions}["8"] == "plan: written by hand"

    fabric.save(tmp_path / "state.ckpt", {"model": model, "opt": opt, "precision": plugin})
    again = lp_fabric.FP8Precision(emulate=True, layers=str(path))
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[again])
    net = net_of(seed=1)
    model, opt = fabric.setup(net, optimizer(net))
    fabric.load(tmp_path / "state.ckpt", {"model": model, "opt": opt, "precision": again})
    assert_formats(net)
    assert_decisions(again)
    assert again.plan == plugin.plan


def test_resuming_under_a_plan_of_other_formats_says_so_and_keeps_the_checkpoints(tmp_path):
    """The checkpoint's plan ran layer 4 in rowwise; resumed with a plan that runs it in the plugin's tensorwise, the
    run says which layers differ and keeps the checkpoint's format (a guard may have stepped it down for a reason):
    the converted layer moves in place, its Parameters the same."""
    plugin = lp_fabric.FP8Precision(emulate=True, layers=plan())
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = net_of()
    model, opt = fabric.setup(net, optimizer(net))
    fabric.save(tmp_path / "state.ckpt", {"model": model, "opt": opt, "precision": plugin})
    edited = plan().with_layer("4", "fp8", "edited")
    again = lp_fabric.FP8Precision(emulate=True, layers=edited)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[again])
    net = net_of()
    model, opt = fabric.setup(net, optimizer(net))
    weight = net[4].weight
    with pytest.warns(UserWarning, match=r"differs from `layers=<PrecisionPlan>` for 1 layer\(s\): 4: fp8 given,"
                                         r" rowwise in the checkpoint"):
        fabric.load(tmp_path / "state.ckpt", {"model": model, "opt": opt, "precision": again})
    assert format_of_layer(net[4]) == "rowwise" and format_of_layer(net[8]) == "mxfp8" and net[4].weight is weight
    assert again.plan_in_force().format_of("4") == "rowwise"


def test_a_plan_format_is_held_to_its_own_gemm_rules():
    """An MXFP8 layer whose dims are not a multiple of 32 stays in high precision, with why, whatever the plugin's
    recipe allows (tensorwise asks 16)."""
    net = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 64))
    layers = (LayerPlan("0", "bf16", ""), LayerPlan("2", "mxfp8", "by hand"), LayerPlan("4", "rowwise", "by hand"))
    plugin = lp_fabric.FP8Precision(emulate=True, layers=PrecisionPlan(layers))
    net = plugin.convert_module(net)
    decisions = {d.fqn: d for d in plugin.layer_decisions}
    assert not decisions["2"].fp8 and "not divisible by 32 (mxfp8 GEMM requirement)" in decisions["2"].reason
    assert decisions["4"].fp8 and decisions["4"].format == "rowwise" and format_of_layer(net[4]) == "rowwise"


def test_an_mxfp8_layer_short_of_a_block_is_reported_alone():
    """Batches of 16 tokens: the MXFP8 layer runs every call in bf16 (its backward casts tokens in blocks of 32) and is
    reported not fp8, with why and a warning naming it; the tensorwise and rowwise layers beside it stay fp8."""
    plugin = lp_fabric.FP8Precision(emulate=True, layers=plan())
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = net_of()
    model, opt = fabric.setup(net, optimizer(net))
    x, y = next(iter(data(rows=16)))
    with pytest.warns(NoEffectWarning, match=r"MXFP8 layers\): 1 layer\(s\) ran every training call.*8 \(16 tokens\)"):
        fabric.backward(nn.functional.cross_entropy(model(x), y))
    decisions = {d.fqn: d for d in plugin.layer_decisions}
    assert not decisions["8"].fp8 and "not a multiple of 32" in decisions["8"].reason
    assert [fqn for fqn, d in decisions.items() if d.fp8] == ["2", "4", "6"]
    metrics = {k: float(v) for k, v in plugin.metrics().items()}
    assert metrics["precision/fp8_layers"] == 3 and "precision/fp8_layers/mxfp8" not in metrics
    assert metrics["precision/fp8_layers/rowwise"] == 1


def test_a_plan_with_a_transformer_engine_recipe_is_refused_by_torchao():
    layers = (LayerPlan("0", "delayed", "by hand"),)
    with pytest.raises(ValueError, match=r"layers=<PrecisionPlan>.*'0': 'delayed'.*tensorwise, rowwise"):
        FP8Precision(emulate=True, layers=PrecisionPlan(layers))


def test_float8_all_gather_needs_every_fp8_layer_tensorwise():
    with pytest.raises(ValueError, match="fsdp_float8_all_gather=True: torchao all-gathers in fp8 with tensorwise"):
        FP8Precision(emulate=True, layers=plan(), fsdp_float8_all_gather=True)


def test_mxfp8_layers_need_capability_10_unless_emulated(monkeypatch):
    """The hardware check asks what the most demanding format of the model needs, not the plugin's recipe."""
    model = Net()
    with pytest.raises(RuntimeError, match=r"\(mxfp8\) needs a CUDA GPU with compute capability >= 10\.0"):
        trainer(FP8Precision(layers=plan("net.")), max_steps=1).fit(model, data())
    assert model.losses == []
    # No CUDA device here: torch.cuda's answers are stubbed to an H100's (9.0), which has fp8 but not MXFP8.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    plugin = lp_fabric.FP8Precision(layers=plan())
    net = plugin.convert_module(net_of())
    with pytest.raises(RuntimeError, match=r"\(mxfp8\) needs CUDA compute capability >= 10\.0.*H100"):
        plugin._on_device_resolved("cuda")
    assert plugin.demote({"8": "the test: no MXFP8 on this GPU"}) == ["8"]
    assert type(net[8]) is nn.Linear and {d.fqn: d.format for d in plugin.layer_decisions}["8"] is None
    plugin._on_device_resolved("cuda")  # tensorwise and rowwise run on an H100


# ---- candidates --------------------------------------------------------------------------------------------------


def test_candidates_default_to_the_recipe_asked_for_else_the_backends():
    # emulated, the choice would be one of speed that emulation lacks: the recipe alone; for a GPU, what it runs
    assert FP8Precision(emulate=True, layers="auto").candidates == ("tensorwise",)
    if not torch.cuda.is_available():  # the prediction is for an H100: torchao's per-tensor and per-row formats
        assert FP8Precision(layers="auto").candidates == ("tensorwise", "rowwise", "rowwise_with_gw_hp")
    assert FP8Precision(emulate=True, layers="auto", recipe="rowwise").candidates == ("rowwise",)
    assert FP8Precision(emulate=True, layers="auto", recipe="rowwise_with_gw_hp").candidates == ("rowwise_with_gw_hp",)
    config = _torchao.torchao_config("rowwise", emulate=True)
    assert FP8Precision(emulate=True, layers="auto", recipe=config).candidates == ("rowwise",)
    assert FP8Precision(emulate=True, layers="auto", candidates=["mxfp8", "tensorwise"]).candidates == (
        "mxfp8", "tensorwise")


@pytest.mark.parametrize(("candidates", "match"), [
    (("tensorwise", "tensorwise"), r"candidates=\('tensorwise', 'tensorwise'\)\)`: 'tensorwise' named more than once"),
    ((), r"candidates=\(\)\)`: name at least one format"),
    ("rowwise", r"candidates='rowwise'\)`: a tuple of format names, e.g. `candidates=\('tensorwise', 'rowwise'\)`"),
    (("rowwise", 8), r"8 is not a torchao format; use tensorwise, rowwise, rowwise_with_gw_hp, mxfp8"),
    (("delayed",), r"'delayed' is not a torchao format"),
    (("bf16", "rowwise"), r"'bf16' is not a torchao format.*High precision is always a choice"),
])
def test_candidates_are_checked_at_construction(candidates, match):
    with pytest.raises(ValueError, match=match):
        FP8Precision(emulate=True, layers="auto", candidates=candidates)


def test_candidates_need_layers_auto():
    with pytest.raises(ValueError, match=r"FP8Precision\(candidates=\('rowwise',\)\)` applies to `layers='auto'` only"):
        FP8Precision(emulate=True, candidates=("rowwise",))


def test_calibration_decides_through_one_method(monkeypatch):
    """`layers='auto'` makes its plan in `_decide` (one place to choose among candidates)."""
    seen = []
    plugin = lp_fabric.FP8Precision(emulate=True, layers="auto", calibration_batches=1, skip_small_layers=False)
    decide = plugin._decide
    monkeypatch.setattr(plugin, "_decide", lambda *args: seen.append(args) or decide(*args))
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = net_of()
    model, opt = fabric.setup(net, optimizer(net))
    for x, y in data(batches=2):
        fabric.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
    assert len(seen) == 1 and plugin.plan is not None


# ---- Transformer Engine (the stand-in of tests/te_standin.py: TE needs CUDA) ------------------------------------------


def test_transformer_engine_candidates_are_its_one_recipe(monkeypatch):
    te_standin.install(monkeypatch)
    plugin = FP8Precision(backend="transformer_engine", recipe="current", layers="auto")
    assert plugin.candidates == ("current",)
    with pytest.raises(ValueError, match=r"recipe is 'delayed'. Transformer Engine runs every layer in the one"
                                         r" recipe.*>= 2.16.*CustomRecipe.*backend='torchao'"):
        FP8Precision(backend="transformer_engine", layers="auto", candidates=("delayed", "current"))


def test_transformer_engine_refuses_a_plan_of_mixed_formats(monkeypatch):
    te_standin.install(monkeypatch)
    mixed = PrecisionPlan((LayerPlan("0", "fp8", ""), LayerPlan("2", "current", ""), LayerPlan("4", "mxfp8", "")))
    with pytest.raises(ValueError, match=r"runs layers in 'current', 'mxfp8' beside this plugin's 'delayed'.*"
                                         r"Transformer Engine >= 2.16's experimental `CustomRecipe`"):
        FP8Precision(backend="transformer_engine", layers=mixed)
    # One format, not the plugin's: the fix is that recipe.
    single = PrecisionPlan((LayerPlan("2", "current", ""),))
    with pytest.raises(ValueError, match=r"pass `recipe='current'`"):
        FP8Precision(backend="transformer_engine", layers=single)
    # The plugin's own recipe by name is the plugin's recipe.
    plugin = FP8Precision(backend="transformer_engine", recipe="current", layers=single)
    assert plugin.plan.layers[0].precision == "current"


def test_mxfp8_with_fp16_compute_is_refused_at_construction_and_left_out_of_the_default_candidates(tmp_path,
                                                                                                 monkeypatch):
    """torchao's MXFP8 casts take bf16 or fp32 ("torch.float16 is not supported yet"): with fp16 compute an MXFP8
    recipe, candidate or plan layer failed at its first forward, after `layers='auto'` had measured its batches."""
    fp16 = {"emulate": True, "compute_dtype": torch.float16}
    with pytest.raises(ValueError, match=r"FP8Precision\(recipe='mxfp8', compute_dtype=torch.float16\)`.*bfloat16"):
        FP8Precision(recipe="mxfp8", **fp16)
    with pytest.raises(ValueError, match=r"candidates=\('tensorwise', 'mxfp8'\).*compute_dtype=torch.float16"):
        FP8Precision(layers="auto", candidates=("tensorwise", "mxfp8"), **fp16)
    path = tmp_path / "plan.yaml"
    path.write_text("version: 1\nlayers:\n  - fqn: a\n    precision: mxfp8\n")
    with pytest.raises(ValueError, match=r"plan.yaml', compute_dtype=torch.float16\)`: the plan runs 1 layer\(s\) in MXFP8 \('a'"):
        FP8Precision(layers=str(path), **fp16)
    # On a B200 (none here: the speed table's entry stands in for this process's GPU) the default candidates include
    # MXFP8, but not under fp16 compute.
    from lightning_precision.fp8 import _speed

    b200 = _speed.speed_device("B200")
    monkeypatch.setattr(_speed, "speed_device", lambda name=None: b200)
    assert "mxfp8" in FP8Precision(layers="auto").candidates
    assert FP8Precision(layers="auto", compute_dtype=torch.float16).candidates == tuple(
        c for c in FP8Precision(layers="auto").candidates if c != "mxfp8")
