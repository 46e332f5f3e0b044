"""One rank of the true-precision scenarios under DDP and FSDP2 (``tests/distributed.py`` starts the ranks, gloo, CPU;
``tests/sharded/test_true_distributed.py`` reads what they write). Two kinds join ``tests.fsdp_worker``'s scenarios and run by
its ``main`` (one launch runs them all, one after the other, in the same two processes): ``true``, a Trainer under
DDP or ``ModelParallelStrategy`` (FSDP2, HSDP), and ``fabric_true``, Fabric under ``ModelParallelStrategy``.

The problem is the issue's regression: a linear layer with weights near 1.0 and AdamW at a learning rate whose every
update is under half a bf16 ulp there (rounded to nearest, the weights never move), so a run that tracks fp32 shows that
the updates landed. Each global batch of 16 rows is split between the ranks.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import lightning as L
import torch
from torch import nn

from lightning_precision._bytes import training_bytes
from tests import fsdp_worker

GLOBAL_BATCH, FEATURES, LR = 16, 32, 1e-3


def make_model(norm: bool = False, out: int = FEATURES) -> nn.Sequential:
    """The regression's layer (``out`` outputs); ``norm``: a LayerNorm after it (a layer a user may keep in fp32)."""
    torch.manual_seed(0)
    layer = nn.Linear(FEATURES, out)
    with torch.no_grad():
        layer.weight.copy_(1.0 + 0.01 * torch.randn(out, FEATURES))
        layer.bias.zero_()
    return nn.Sequential(layer, nn.LayerNorm(out)) if norm else nn.Sequential(layer)


def make_data(steps: int, out: int = FEATURES) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps * GLOBAL_BATCH, FEATURES, generator=g)
    target = make_model(out=out).state_dict()["0.weight"] + 0.03 * torch.randn(out, FEATURES, generator=g)
    return x, x @ target.T


def make_plugin(cfg: dict, fabric: bool = False) -> Any:
    import lightning_precision
    from lightning_precision import fabric as fabric_plugins

    plugins: Any = fabric_plugins if fabric else lightning_precision
    if cfg["plugin"] == "32":
        return None
    cls = plugins.BF16TruePrecision if cfg["plugin"] == "bf16" else plugins.FP16TruePrecision
    kwargs = dict(cfg.get("plugin_kwargs", {}))
    if kwargs.pop("keep_norms_fp32", False):
        kwargs["keep_fp32"] = (nn.LayerNorm,)
    return cls(**kwargs)


def digest(tensor: torch.Tensor) -> str:
    """The bits of a (local) tensor."""
    return hashlib.sha256(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def describe(value: Any) -> str:
    """``DTensor(bfloat16)``, ``Tensor(float16)``, ``int``: what a parameter or a state is, locally."""
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    local = value.to_local() if hasattr(value, "to_local") else value
    return f"{type(value).__name__}({str(local.dtype).replace('torch.', '')})"


def local_kind(value: Any) -> str | None:
    """A state's local tensor, ``Tensor(<dtype>)``."""
    if not isinstance(value, torch.Tensor):
        return None
    local = value.to_local() if hasattr(value, "to_local") else value
    return f"Tensor({str(local.dtype).replace('torch.', '')})"


class Regression(L.LightningModule):
    """The model built in ``__init__`` (in fp32, as users build it), sharded in ``configure_model`` when the scenario
    says so; rank 0's batch at ``poison_step`` is made to overflow."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = make_model(cfg.get("norm", False), cfg.get("out", FEATURES))
        self.losses: list[float] = []
        self.skipped: list[bool] = []

    def configure_model(self) -> None:
        if self.cfg.get("sharded"):
            plugin: Any = self.trainer.precision_plugin
            mesh: Any = self.device_mesh
            policy = plugin.mp_policy if self.cfg.get("policy") else None
            if self.cfg.get("hsdp"):  # replicated across the ranks, sharded within each (one rank): HSDP's 2-D mesh
                from torch.distributed.device_mesh import init_device_mesh

                hsdp = init_device_mesh("cpu", (self.trainer.world_size, 1), mesh_dim_names=("replicate", "shard"))
                fsdp_worker.shard(self.model, hsdp, policy)
            elif self.cfg.get("root_only"):  # one group for the whole model
                from torch.distributed.fsdp import fully_shard

                fully_shard(self.model, mesh=mesh["data_parallel"], **({"mp_policy": policy} if policy else {}))
            else:
                fsdp_worker.shard(self.model, mesh["data_parallel"], policy)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.cfg.get("poison_step") == self.global_step and self.global_rank == 0:
            x = x * 1e4  # squared errors over fp16's 65504: the loss and the gradients overflow, on rank 0 alone
        loss = nn.functional.mse_loss(self.model(x), y)
        self.losses.append(loss.item())
        return loss

    def on_after_backward(self) -> None:
        if self.cfg.get("poison_shard_step") == self.global_step and self.global_rank == 1:
            fsdp_worker.poison_grad(self.model[0])  # an inf in rank 1's shard of the gradient only

    def on_train_batch_end(self, *args: Any) -> None:
        self.skipped.append(bool(getattr(self.trainer.precision_plugin, "step_was_skipped", False)))

    def configure_optimizers(self) -> Any:
        if self.cfg.get("optimizer") == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05)
        return torch.optim.AdamW(self.parameters(), lr=LR)


def run_true(cfg: dict, rank: int, world: int) -> dict:
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    plugin = make_plugin(cfg)
    if cfg.get("sharded"):
        strategy: Any = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1,
                                              save_distributed_checkpoint=not cfg.get("full_checkpoint"))
    else:
        strategy = DDPStrategy(process_group_backend="gloo")
    save = cfg.get("save_every")
    callbacks: list[Callback] = []
    if save:  # the strategy's own checkpoint (a directory under FSDP2), saved from inside the loop
        callbacks.append(ModelCheckpoint(dirpath=cfg["save_to"], filename="ckpt", every_n_train_steps=save,
                                         save_top_k=-1))
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, plugins=[plugin] if plugin else None,
                        precision=None if plugin else "32-true", max_steps=cfg["steps"], logger=False,
                        callbacks=callbacks, enable_checkpointing=bool(save), enable_progress_bar=False,
                        gradient_clip_val=cfg.get("clip"),
                        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False)
    module = Regression(cfg)
    x, y = make_data(cfg.get("data_steps", cfg["steps"]), cfg.get("out", FEATURES))
    dataset = TensorDataset(x, y)
    # Interleaved, not shuffled: each global batch of 16 rows split between the ranks.
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
    trainer.fit(module, DataLoader(dataset, batch_size=GLOBAL_BATCH // world, sampler=sampler),
                ckpt_path=cfg.get("resume"))
    params = dict(module.model.named_parameters())
    (optimizer,) = trainer.optimizers
    state = optimizer.state[params["0.weight"]]
    return {
        "losses": module.losses, "skipped": module.skipped, "global_step": trainer.global_step,
        "skipped_steps": getattr(plugin, "skipped_steps", None), "loss_scale": getattr(plugin, "loss_scale", None),
        "params": fsdp_worker.full_params(module.model),
        "digests": {name: digest(p.to_local() if hasattr(p, "to_local") else p) for name, p in params.items()},
        "param_types": {name: describe(p) for name, p in params.items()},
        "grad_types": {name: describe(p.grad) for name, p in params.items() if p.grad is not None},
        "state_types": {str(key): describe(value) for key, value in state.items()},
        "local_state": "8-bit" if "lp.q8.exp_avg" in state else local_kind(state.get("exp_avg")),
        "codes": describe(state.get("lp.q8.exp_avg")),
        "bytes": dataclasses.asdict(training_bytes(module.model, trainer.optimizers)),
    }


def run_fabric_true(cfg: dict, rank: int, world: int) -> dict:
    """The same under Fabric and FSDP2, by hand: ``fabric.save`` after ``save_at`` steps, ``fabric.load`` of
    ``resume`` (then the steps after it), as Fabric users checkpoint."""
    from lightning.fabric.strategies import ModelParallelStrategy

    plugin = make_plugin(cfg, fabric=True)

    def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        if cfg.get("root_only"):
            fully_shard(model, mesh=mesh["data_parallel"], mp_policy=plugin.mp_policy)
            return model
        return fsdp_worker.shard(model, mesh["data_parallel"], plugin.mp_policy)

    strategy = ModelParallelStrategy(parallelize, data_parallel_size=world, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy, plugins=[plugin])
    fabric.launch()
    net = make_model(cfg.get("norm", False), cfg.get("out", FEATURES))
    model = fabric.setup_module(net)
    optimizer: Any = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    if cfg.get("resume"):
        fabric.load(cfg["resume"], state)
    x, y = make_data(cfg.get("data_steps", cfg["steps"]), cfg.get("out", FEATURES))
    half = GLOBAL_BATCH // world
    losses = []
    for step in range(state["step"], cfg["steps"]):
        rows = slice(step * GLOBAL_BATCH + rank * half, step * GLOBAL_BATCH + (rank + 1) * half)
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        losses.append(loss.item())
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        state["step"] = step + 1
        if cfg.get("save_at") == step + 1:
            fabric.save(cfg["save_to"], state)
    return {"losses": losses, "skipped_steps": plugin.skipped_steps, "loss_scale": plugin.loss_scale,
            "params": fsdp_worker.full_params(net)}


fsdp_worker.SCENARIOS["true"] = run_true
fsdp_worker.SCENARIOS["fabric_true"] = run_fabric_true

if __name__ == "__main__":
    from tests.cuda_kernels import refusing_what_cuda_refuses

    with refusing_what_cuda_refuses():  # as in the test process: the AMP ops refuse what CUDA refuses
        fsdp_worker.main()
