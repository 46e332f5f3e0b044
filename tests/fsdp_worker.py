"""One rank of sharded-training scenarios (``tests/distributed.py`` starts the ranks): FSDP2 on CPU with gloo.

A scenario names the API (``fabric``, ``trainer`` or ``torchao``: torchao's own FSDP2 recipe written by hand), the
plugin and what to inject; the rank writes what it saw to ``<scenario dir>/rank<r>.json`` and rank 0 the full
parameters to ``<scenario dir>/params.pt``. One launch runs several scenarios, one after the other (``main``). Every
global batch of 16 rows is split between the ranks, so the ranks together see exactly what one process on the whole
batch sees (``reference`` runs that one process).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

from tests.distributed import finish

GLOBAL_BATCH, IN, HIDDEN, OUT = 16, 64, 128, 16


def make_model(kind: str = "mlp", seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    if kind == "conv":  # image batches (N, 3, 8, 8)
        return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, OUT))
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def make_data(steps: int, kind: str = "mlp", seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps * GLOBAL_BATCH, IN, generator=g)
    y = (x @ torch.randn(IN, OUT, generator=g)).argmax(dim=1)
    if kind == "conv":
        x = x[:, :48].reshape(-1, 3, 4, 4).repeat_interleave(2, dim=2).repeat_interleave(2, dim=3)
    return x, y


def make_plugin(name: str, trainer: bool, **kwargs: Any) -> Any:
    import lightning_precision as trainer_plugins
    from lightning_precision import fabric as fabric_plugins

    ns = trainer_plugins if trainer else fabric_plugins
    if name == "bf16":
        return ns.BF16MixedPrecision(**kwargs)
    if name == "fp16":
        return ns.FP16MixedPrecision(init_scale=1024.0, **kwargs)
    if name == "fp8":
        return ns.FP8Precision(emulate=True, skip_small_layers=False, skip_first_last=False, **kwargs)
    raise ValueError(name)


def shard(model: nn.Module, mesh: Any, policy: Any) -> nn.Module:
    """Each linear layer, then the root: the layout FSDP2's docs recommend."""
    from torch.distributed.fsdp import fully_shard

    kwargs = {"mp_policy": policy} if policy is not None else {}
    for layer in model.modules():
        if isinstance(layer, (nn.Linear, nn.Conv2d)):
            fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
            for name, p in model.named_parameters()}


def layer_types(model: nn.Module) -> list[str]:
    return [type(m).__name__ for m in model.modules() if isinstance(m, nn.Linear)]


def record_conv_outputs(model: nn.Module, seen: list[bool]) -> None:
    """Whether each convolution's output in a training forward is channels-last."""
    from lightning_precision.callbacks.channels_last import is_channels_last

    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            m.register_forward_hook(lambda mod, args, out: seen.append(is_channels_last(out)) if mod.training else None)


def poison_grad(layer: nn.Module) -> None:
    """An inf in this rank's shard of the first layer's weight gradient only."""
    grad = layer.weight.grad
    local = grad.to_local() if hasattr(grad, "to_local") else grad  # a view: writes reach the gradient
    local.view(-1)[0] = float("inf")


def rescale(model: nn.Module) -> None:
    """Weights changed in place outside an optimizer step (as a checkpoint loaded into a live model, or an EMA swap):
    four times larger, so an fp8 scale computed before would saturate them."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)


# ---- scenarios -------------------------------------------------------------------------------------------------------


def run_fabric(cfg: dict, rank: int, world: int) -> dict:
    from lightning.fabric.strategies import ModelParallelStrategy

    plugin = make_plugin(cfg["plugin"], trainer=False, **cfg.get("plugin_kwargs", {}))
    policy = plugin.mp_policy if cfg.get("policy") else None
    strategy = ModelParallelStrategy(lambda m, mesh: shard(m, mesh["data_parallel"], policy),
                                     data_parallel_size=world, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy, plugins=[plugin])
    fabric.launch()
    model = fabric.setup_module(make_model())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    x, y = make_data(cfg["steps"])
    losses, skipped = [], []
    half = GLOBAL_BATCH // world
    for step in range(cfg["steps"]):
        rows = slice(step * GLOBAL_BATCH + rank * half, step * GLOBAL_BATCH + (rank + 1) * half)
        loss = nn.functional.cross_entropy(model(x[rows]), y[rows])
        losses.append(loss.item())
        optimizer.zero_grad()
        fabric.backward(loss)
        if cfg.get("inf_step") == step and rank == 1:
            poison_grad(model.module[0])
        optimizer.step()
        skipped.append(getattr(plugin, "step_was_skipped", False))
        if cfg.get("rescale_at") == step:
            rescale(model)
    out = {"losses": losses, "skipped": skipped, "loss_scale": plugin.loss_scale, "skipped_steps": plugin.skipped_steps,
           "layer_types": layer_types(model.module), "params": full_params(model.module)}
    if cfg["plugin"] == "fp8":
        out["float8_all_gather"] = plugin._float8_all_gather
    return out


def run_torchao(cfg: dict, rank: int, world: int) -> dict:
    """torchao's FSDP2 recipe, written by hand (its README): convert, fully_shard, precompute after each step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

    from lightning_precision._core import fsdp

    if not dist.is_initialized():  # an earlier scenario of the launch set it up
        dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,))
    config = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=cfg.get("float8_all_gather", True))
    model = convert_to_float8_training(make_model(), config=config)
    policy = torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                         cast_forward_inputs=False) if cfg.get("policy") else None
    shard(model, mesh, policy)
    if config.enable_fsdp_float8_all_gather:
        fsdp.install_byte_all_gather(model)  # gloo has no float8 dtype
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = make_data(cfg["steps"])
    losses = []
    half = GLOBAL_BATCH // world
    for step in range(cfg["steps"]):
        rows = slice(step * GLOBAL_BATCH + rank * half, step * GLOBAL_BATCH + (rank + 1) * half)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x[rows]).float(), y[rows])
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        precompute_float8_dynamic_scale_for_fsdp(model)
        if cfg.get("rescale_at") == step:
            rescale(model)
            precompute_float8_dynamic_scale_for_fsdp(model)  # by hand, the scales are redone for the new weights
    return {"losses": losses, "layer_types": layer_types(model), "params": full_params(model)}


class ShardedModule(L.LightningModule):
    """The same model under the Trainer: sharded in ``configure_model``, converted first when the plugin is fp8."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = make_model(cfg.get("model", "mlp"))
        self.losses: list[float] = []
        self.skipped: list[bool] = []
        self.batches: list[tuple[int, int]] = []

    def configure_model(self) -> None:
        plugin = self.trainer.precision_plugin
        if self.cfg.get("convert_first", True):
            plugin.convert_module(self)  # fp8 layers before fully_shard (a no-op for bf16/fp16)
        shard(self.model, self.device_mesh["data_parallel"], plugin.mp_policy if self.cfg.get("policy") else None)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.losses.append(loss.item())
        self.batches.append((self.current_epoch, batch_idx))
        return loss

    def on_after_backward(self) -> None:
        if self.cfg.get("inf_step") == self.global_step and self.global_rank == 1:
            poison_grad(self.model[0])

    def on_train_batch_end(self, *args: Any) -> None:
        self.skipped.append(getattr(self.trainer.precision_plugin, "step_was_skipped", False))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def run_trainer(cfg: dict, rank: int, world: int) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    plugin = make_plugin(cfg["plugin"], trainer=True, **cfg.get("plugin_kwargs", {}))
    callbacks = []
    counted: list[int] = []
    if "monitor" in cfg.get("callbacks", ()):
        from lightning_precision.callbacks import GradientUnderflowMonitor

        monitor = GradientUnderflowMonitor(formats=("fp16", "e5m2"), log_every_n_steps=cfg.get("log_every", 1),
                                           measure_every_n_steps=1, top_k=2)
        sync = monitor.state.sync

        def count(reduce: Any, names: Any = None) -> Any:  # how many gradient elements the ranks counted together
            synced = sync(reduce, names)
            if "count/param/fp16" in synced:
                counted.append(int(synced["count/param/fp16"][0]))  # CastStats' first field: numel
            return synced

        monitor.state.sync = count  # type: ignore[method-assign]
        callbacks.append(monitor)
    if "amax" in cfg.get("callbacks", ()):
        from lightning_precision.callbacks import AmaxHistoryLogger

        amax = AmaxHistoryLogger(log_every_n_steps=1)
        callbacks.append(amax)
    if "channels_last" in cfg.get("callbacks", ()):
        from lightning_precision.callbacks import ChannelsLast

        channels_last = ChannelsLast()
        callbacks.append(channels_last)
    if cfg.get("save_every"):  # a distributed checkpoint (a directory) from inside the loop, as users save them
        callbacks.append(ModelCheckpoint(dirpath=cfg["save_to"], filename="ckpt", every_n_train_steps=cfg["save_every"],
                                         save_top_k=-1))
    trainer = L.Trainer(accelerator="cpu", devices=world, plugins=[plugin], max_steps=cfg["steps"], logger=False,
                        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
                        callbacks=callbacks, enable_checkpointing=bool(cfg.get("save_every")),
                        enable_progress_bar=False, log_every_n_steps=1, enable_model_summary=False,
                        num_sanity_val_steps=0, use_distributed_sampler=False)
    module = ShardedModule(cfg)
    conv_outputs: list[bool] = []
    record_conv_outputs(module.model, conv_outputs)
    x, y = make_data(cfg.get("data_steps", cfg["steps"]), cfg.get("model", "mlp"))
    dataset = TensorDataset(x, y)
    # Interleaved, not shuffled: each global batch of 16 rows is split between the ranks, as in `reference`.
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
    data = DataLoader(dataset, batch_size=GLOBAL_BATCH // world, sampler=sampler)
    trainer.fit(module, data, ckpt_path=cfg.get("resume"))
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("precision/")}
    if "amax" in cfg.get("callbacks", ()):
        logged.update(amax.last_metrics)
        logged.update(amax_history=amax.chronological_history().tolist(), amax_steps=amax.steps)
    if "monitor" in cfg.get("callbacks", ()):
        logged["histogram"] = monitor.histogram.tolist()
    if "channels_last" in cfg.get("callbacks", ()):
        from lightning_precision.functional import apply_channels_last

        logged.update(weights_channels_last=channels_last.weights_channels_last, converted=channels_last.converted,
                      first_conv_input_channels_last=channels_last.first_conv_input_channels_last,
                      conv_outputs_channels_last=conv_outputs)
        try:  # what a Fabric user who converts the sharded model gets
            apply_channels_last(module.model)
        except ValueError as err:
            logged["apply_error"] = str(err)
    out = {"logged": logged,
           "counted": counted, "losses": module.losses, "skipped": module.skipped, "loss_scale": plugin.loss_scale,
           "skipped_steps": plugin.skipped_steps, "layer_types": layer_types(module.model),
           "global_step": trainer.global_step, "batches": module.batches, "params": full_params(module.model)}
    if cfg["plugin"] == "fp8":
        out["float8_all_gather"] = plugin._float8_all_gather
    return out


def run_gloo_average(cfg: dict, rank: int, world: int) -> dict:
    """Whether this torch's gloo averages in a reduce-scatter (FSDP2's gradient reduction), asked without our code."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    out = torch.zeros(1)
    dist.reduce_scatter_tensor(out, torch.full((world,), float(rank + 1)), op=dist.ReduceOp.AVG)
    return {"averages": out.item() == (world + 1) / 2}


SCENARIOS = {"fabric": run_fabric, "torchao": run_torchao, "trainer": run_trainer, "gloo_average": run_gloo_average}


def reference(plugin_name: str, steps: int, kind: str = "mlp") -> dict:
    """One process, the whole global batch, the same plugin, no sharding: what the ranks must reproduce."""
    plugin = make_plugin(plugin_name, trainer=False)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = make_model(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    x, y = make_data(steps, kind)
    losses = []
    for step in range(steps):
        rows = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        loss = nn.functional.cross_entropy(model(x[rows]), y[rows])
        losses.append(loss.item())
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
    return {"losses": losses, "params": full_params(model.module)}


def ours(w: warnings.WarningMessage) -> bool:
    """A warning of this package: of its own category, or a plain one that names its callback."""
    return w.category.__module__.startswith("lightning_precision") or str(w.message).startswith(
        ("GradientUnderflowMonitor", "AmaxHistoryLogger", "ChannelsLast"))


def run_one(cfg: dict, out_dir: Path, rank: int, world: int) -> None:
    """One scenario; what the rank saw goes to ``out_dir``. Global torch state a plugin sets (and a Fabric run, which
    has no teardown, leaves set) is restored for the next scenario of the launch, as tests/conftest.py does."""
    out_dir.mkdir(exist_ok=True)
    dtype, matmul = torch.get_default_dtype(), torch.get_float32_matmul_precision()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = SCENARIOS[cfg["api"]](cfg, rank, world)
        except Exception as err:
            if not cfg.get("expect_error"):
                raise
            result = {"error": f"{type(err).__name__}: {err}"}
    torch.set_default_dtype(dtype)
    torch.set_float32_matmul_precision(matmul)
    result["warnings"] = sorted({f"{w.category.__name__}: {w.message}" for w in caught if ours(w)})
    params = result.pop("params", None)
    if rank == 0 and params is not None:
        torch.save(params, out_dir / "params.pt")
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    """The launch's scenarios (``<out_dir>/scenarios.json``, name -> scenario), in order, each into
    ``<out_dir>/<name>/``. A scenario that raises ends the rank, and so the launch (``start_ranks`` stops the
    others)."""
    import torch.distributed as dist

    out_dir = Path(sys.argv[1])
    scenarios = json.loads((out_dir / "scenarios.json").read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    environ = dict(os.environ)
    for name, cfg in scenarios.items():
        os.environ.clear()  # Lightning's environment removes WORLD_SIZE at a Trainer's teardown
        os.environ.update(environ)
        run_one(cfg, out_dir / name, rank, world)
        if dist.is_initialized():
            dist.barrier()  # the ranks start each scenario together
    finish()


if __name__ == "__main__":
    from tests.cuda_kernels import refusing_what_cuda_refuses

    with refusing_what_cuda_refuses():  # as in the test process: the AMP ops refuse what CUDA refuses
        main()
