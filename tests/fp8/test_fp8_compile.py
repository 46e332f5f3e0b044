"""``torch.compile`` of a model under ``FP8Precision`` gives as many graphs as torchao's own
``convert_to_float8_training`` + ``torch.compile`` of the same model, with the Trainer and with Fabric, and what the
plugin reports of the layers that ran stays true. Real torchao (``emulate=True``), real fits.

The graphs are counted with dynamo's ``CompileCounter`` backend, which runs each graph as traced: how many graphs
there are is dynamo's decision (its guards), not the backend's, and this keeps the test fast (``benchmarks/
compile_graphs.py`` counts with ``aot_eager`` or inductor)."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import lightning as L
import pytest
import torch
from torch import nn

from lightning_precision import FP8Precision, NoEffectWarning
from lightning_precision.fabric import FP8Precision as FabricFP8Precision

pytest.importorskip("torchao")
torch_dynamo_testing = pytest.importorskip("torch._dynamo.testing")

FP8_KW: dict[str, Any] = {"emulate": True, "skip_small_layers": False, "skip_first_last": False}
STEPS = 3


class Net(nn.Module):
    """Three fp8 layers; ``unused`` is chosen for fp8 but its forward never runs (its weight is read directly, as
    ``nn.MultiheadAttention`` reads ``out_proj``'s)."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 32)
        self.unused = nn.Linear(64, 64) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.unused is not None:
            h = h + nn.functional.linear(h, self.unused.weight.to(h.dtype))
        return self.c(torch.relu(self.b(h)))


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(32, 64, generator=g) for _ in range(STEPS)]


def torchao_graphs(unused: bool = False) -> int:
    """torchao's own conversion of the same layers, compiled, trained as the plugin trains it (bf16 autocast)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch._dynamo.reset()
    counter = torch_dynamo_testing.CompileCounter()
    model = Net(unused)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True)
    convert_to_float8_training(model, config=config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = torch.compile(model, backend=counter)
    for x in batches():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = compiled(x).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    torch._dynamo.reset()
    return counter.frame_count


def fabric_graphs(plugin: Any, unused: bool = False) -> int:
    torch._dynamo.reset()
    counter = torch_dynamo_testing.CompileCounter()
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = Net(unused)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # Fabric converts the module it unwraps and compiles it again with a deep copy of the arguments: a function
    # (copied as itself) reaches the counter.
    model, optimizer = fabric.setup(cast(nn.Module, torch.compile(model, backend=lambda gm, inputs: counter(gm, inputs))),
                                     optimizer)
    for x in batches():
        loss = model(x).float().square().mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    torch._dynamo.reset()
    return counter.frame_count


class LitNet(L.LightningModule):
    def __init__(self, counter: Any, unused: bool = False) -> None:
        super().__init__()
        self.net: nn.Module = Net(unused)
        self.counter = counter

    def on_fit_start(self) -> None:
        self.net = cast(nn.Module, torch.compile(self.net, backend=self.counter))  # after the plugin converted it (the docs' order)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch).float().square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def trainer_graphs(plugin: Any, unused: bool = False) -> int:
    torch._dynamo.reset()
    counter = torch_dynamo_testing.CompileCounter()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, plugins=[plugin], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LitNet(counter, unused), torch.utils.data.DataLoader(cast(Any, batches()), batch_size=None))
    torch._dynamo.reset()
    return counter.frame_count


def test_a_compiled_fp8_model_is_as_many_graphs_as_torchaos_own_conversion_with_fabric():
    """The plugin watched which layers ran with forward pre-hooks it removed after the first backward: dynamo guards
    on a module's hooks, so the second step compiled the model again (2 graphs against torchao's 1)."""
    plugin = FabricFP8Precision(**FP8_KW)
    assert fabric_graphs(plugin) == torchao_graphs()  # 1 on torch 2.13: the goal is torchao's count, any torch
    assert plugin.metrics()["precision/fp8_layers"].item() == 3


def test_a_compiled_fp8_model_is_as_many_graphs_as_torchaos_own_conversion_with_the_trainer():
    plugin = FP8Precision(**FP8_KW)
    assert trainer_graphs(plugin) == torchao_graphs()
    assert plugin.metrics()["precision/fp8_layers"].item() == 3


@pytest.mark.parametrize("loop", ["fabric", "trainer"])
def test_compiled_a_layer_whose_forward_never_runs_is_still_reported(loop):
    """What the watch reports stays true under compile: ``unused`` is converted but never runs its forward, so it is
    named in the warning and not counted as fp8; the graphs stay as many as torchao's."""
    plugin = FabricFP8Precision(**FP8_KW) if loop == "fabric" else FP8Precision(**FP8_KW)
    run = fabric_graphs if loop == "fabric" else trainer_graphs
    with pytest.warns(NoEffectWarning, match=r"did not run their forward in the first training step: (net\.)?unused"):
        graphs = run(plugin, unused=True)
    assert graphs == torchao_graphs(unused=True)
    assert [d.fqn.removeprefix("net.") for d in plugin.layer_decisions if d.fp8] == ["a", "b", "c"]
    assert plugin.metrics()["precision/fp8_layers"].item() == 3


def test_rowwise_scaling_is_as_many_graphs_as_torchaos_own_conversion_too():
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    recipe = "rowwise"
    torch._dynamo.reset()
    counter = torch_dynamo_testing.CompileCounter()
    model = Net()
    convert_to_float8_training(model, config=dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe),
                                                                 emulate=True))
    compiled = torch.compile(model, backend=counter)
    try:
        for x in batches():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                compiled(x).float().square().mean().backward()
    except torch._dynamo.exc.TorchRuntimeError as err:
        torch._dynamo.reset()
        if "axiswise scaling is not supported" not in str(err):
            raise
        pytest.skip("this torchao's own rowwise layers do not compile (torchao 0.11: aten._to_copy with axiswise scaling"
                    " is not supported): no peer to count against")
    assert fabric_graphs(FabricFP8Precision(recipe=recipe, **FP8_KW)) == counter.frame_count


def test_transformer_engine_layers_keep_their_watch_hook_and_the_model_pickles(monkeypatch):
    """Layers whose class does not record its own calls (Transformer Engine's; a stand-in here, TE needs CUDA) are
    watched by a forward pre-hook that stays after the first step: dynamo guards on a module's hooks, so removing it
    recompiled the model. A layer that never runs is still reported, and the model pickles (``torch.save(model)``)."""
    import pickle

    from tests import te_standin

    te = te_standin.install(monkeypatch)
    plugin = FabricFP8Precision(backend="transformer_engine", skip_small_layers=False, skip_first_last=False)
    model = plugin.convert_module(Net(unused=True))
    assert type(model.a) is te.Linear
    hooks = {name: list(m._forward_pre_hooks.values()) for name, m in model.named_modules()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.warns(NoEffectWarning, match=r"did not run their forward in the first training step: unused"):
        for x in batches():
            with torch.autocast("cpu", dtype=torch.bfloat16):  # the stand-in computes in high precision
                loss = model(x).float().square().mean()
            plugin.backward(loss, model)
            optimizer.step()
            optimizer.zero_grad()
    assert {name: list(m._forward_pre_hooks.values()) for name, m in model.named_modules()} == hooks
    assert [d.fqn for d in plugin.layer_decisions if d.fp8] == ["a", "b", "c"]
    copy = pickle.loads(pickle.dumps(model))
    assert len(copy.a._forward_pre_hooks) == len(model.get_submodule("a")._forward_pre_hooks) == 1


def test_a_compiled_torchao_model_keeps_its_compile_watch_and_saves_whole(tmp_path):
    """A compiled model keeps the plugin's compile-watch pre-hooks (dynamo guards on a module's hooks: removing them
    would compile it again); saved whole (``torch.save(model)``) it still loads and computes the same."""
    from lightning_precision.fp8._step_shapes import CompileWatch

    torch._dynamo.reset()
    plugin = FabricFP8Precision(**FP8_KW)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = Net()
    model, optimizer = fabric.setup(cast(nn.Module, torch.compile(net, backend="eager")),
                                    torch.optim.SGD(net.parameters(), lr=0.01))
    x = batches()[0]
    fabric.backward(model(x).float().square().mean())
    optimizer.step()
    torch._dynamo.reset()
    assert any(isinstance(getattr(hook, "__self__", None), CompileWatch) for hook in net.a._forward_pre_hooks.values())
    torch.save(net, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert type(loaded.a).__name__ == "Float8Linear"
    torch.testing.assert_close(loaded(x), net(x))


def test_compiled_mxfp8_layers_compile_nothing_after_the_first_step():
    """An MXFP8 layer records that a training call ran in MXFP8 by writing a flag, not by reading it first: a flag the
    graph reads is guarded on, and its change after the first step compiled every MXFP8 layer's forward again. And the
    layer's matmul function is resolved with its class, not imported in each forward: that import broke the graph in
    every MXFP8 layer (12 graphs for this model, now 1)."""
    pytest.importorskip("torchao.prototype.moe_training.mxfp8_linear")
    plugin = FabricFP8Precision(recipe="mxfp8", **FP8_KW)
    assert _graphs_per_step(plugin, batches()) == [1] * STEPS
    assert plugin.metrics()["precision/fp8_layers"].item() == 3


def _graphs_per_step(plugin, steps) -> list[int]:
    """A compiled ``Net`` trained under ``plugin`` with Fabric on ``steps``: the graphs compiled so far, per step."""
    torch._dynamo.reset()
    counter = torch_dynamo_testing.CompileCounter()
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(cast(nn.Module, torch.compile(model, backend=lambda gm, inputs: counter(gm, inputs))),
                                     optimizer)
    graphs = []
    for x in steps:
        fabric.backward(model(x).float().square().mean())
        optimizer.step()
        optimizer.zero_grad()
        graphs.append(counter.frame_count)
    torch._dynamo.reset()
    return graphs


def test_a_model_saved_whole_with_the_earlier_watch_hook_still_loads(tmp_path):
    """Earlier releases watched with ``ForwardWatch._count`` as a pre-hook and left it on a layer that never ran: a
    model saved whole (``torch.save(model)``) after such a fit pickles it by name, so the name stays loadable."""
    import functools

    from lightning_precision.fp8._watch import ForwardWatch

    layer = nn.Linear(4, 4)
    watch = ForwardWatch.__new__(ForwardWatch)  # as unpickled: the earlier release's fields do not matter
    layer.register_forward_pre_hook(functools.partial(watch._count, "unused"))
    torch.save(layer, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    torch.testing.assert_close(loaded(torch.ones(1, 4)), layer(torch.ones(1, 4)))


def test_a_compiled_plan_of_mixed_formats_compiles_nothing_after_the_first_step():
    """MXFP8, rowwise and a high-precision layer side by side in one compiled model: one graph, none again later."""
    pytest.importorskip("torchao.prototype.moe_training.mxfp8_linear")
    from lightning_precision.fp8 import LayerPlan, PrecisionPlan

    plan = PrecisionPlan((LayerPlan("a", "mxfp8", "x"), LayerPlan("b", "rowwise", "x"), LayerPlan("c", "bf16", "x")))
    plugin = FabricFP8Precision(layers=plan, emulate=True)
    assert _graphs_per_step(plugin, batches() * 2) == [1] * 2 * STEPS
    assert plugin.metrics()["precision/fp8_layers"].item() == 2
