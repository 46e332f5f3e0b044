"""``eval_precision=`` under the Trainer (issue 39): validation, test, predict and sanity checking run in the precision
asked, while training, its aten ops, the weights it reaches and the checkpoints it saves are those of the same fit
without it; every plugin checks the argument once, in the shared core."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_precision as lp
from lightning_precision import fabric as lpf
from lightning_precision._step_ops import StepOps
from tests import te_standin
from tests.helpers import LitNet, assert_same_bits, loader, make_data, make_net, trainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# Each Trainer plugin built to run here, by name: (class, keyword arguments, its training dtype).
RUNNABLE: dict[str, tuple[type, dict[str, Any], torch.dtype]] = {
    "BF16MixedPrecision": (lp.BF16MixedPrecision, {}, torch.bfloat16),
    "FP16MixedPrecision": (lp.FP16MixedPrecision, {}, torch.float16),
    # XPUPrecision targets "xpu", which does not exist here: `device="cpu"` runs the same logic.
    "XPUPrecision": (lp.XPUPrecision, {"device": "cpu"}, torch.bfloat16),
    "FP8Precision": (lp.FP8Precision, {"emulate": True, "skip_small_layers": False}, torch.bfloat16),
    "BF16TruePrecision": (lp.BF16TruePrecision, {}, torch.bfloat16),
    "FP16TruePrecision": (lp.FP16TruePrecision, {}, torch.float16),
}
TRUE = ("BF16TruePrecision", "FP16TruePrecision")


class _Recorder(LitNet):
    """Records, per Trainer stage, the dtype of the first linear layer's output (never converted to fp8: the first)
    and whether autocast was on there."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, set[tuple[torch.dtype, bool]]] = {}
        self.net[0].register_forward_hook(self._record)

    def _record(self, module: Any, args: Any, output: torch.Tensor) -> None:
        stage = self.trainer.state.stage.value
        self.seen.setdefault(stage, set()).add((output.dtype, torch.is_autocast_enabled("cpu")))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])


def _plugin(name: str, eval_precision: str | None) -> Any:
    cls, kwargs, _ = RUNNABLE[name]
    return cls(**kwargs, eval_precision=eval_precision)


def _fit(plugin: Any, tmp_path: Path | None = None) -> tuple[_Recorder, L.Trainer]:
    model, data = _Recorder(), make_data(4)
    callbacks = [ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)] if tmp_path is not None else []
    run = trainer(plugin, max_steps=2, accumulate_grad_batches=2, val_check_interval=2, limit_val_batches=1,
                  num_sanity_val_steps=1, callbacks=callbacks, enable_checkpointing=tmp_path is not None)
    run.fit(model, loader(data), loader(data))
    return model, run


@pytest.mark.parametrize("name", sorted(RUNNABLE))
def test_validation_runs_in_fp32_while_training_is_bit_identical_and_checkpoints_unchanged(name, tmp_path):
    """A fit with sanity checking, gradient accumulation and validation, with and without ``eval_precision="32-true"``:
    the same weights and the same checkpoint (keys, dtypes, values); validation and sanity checking in fp32 without
    autocast, training in the plugin's dtype."""
    _, _, dtype = RUNNABLE[name]
    plain, _ = _fit(_plugin(name, None), tmp_path / "plain")
    fp32, _ = _fit(_plugin(name, "32-true"), tmp_path / "fp32")
    assert_same_bits(list(fp32.parameters()), list(plain.parameters()))
    training = {(dtype, name not in TRUE)}
    assert plain.seen == {"sanity_check": training, "train": training, "validate": training}
    assert fp32.seen == {"sanity_check": {(torch.float32, False)}, "train": training,
                         "validate": {(torch.float32, False)}}
    saved = [torch.load(path / "last.ckpt", weights_only=False) for path in (tmp_path / "plain", tmp_path / "fp32")]
    for key in ("state_dict", "optimizer_states"):
        assert_same_bits(saved[1][key], saved[0][key], key)


@pytest.mark.parametrize("name", ["FP16MixedPrecision", "FP8Precision"])
def test_validate_test_predict_run_in_bf16_autocast_and_leave_the_model_and_optimizer_as_they_were(name):
    model, run = _fit(_plugin(name, "bf16-mixed"))
    before = ([p.detach().clone() for p in model.parameters()], [p for p in model.parameters()],
              [p.dtype for p in model.parameters()], run.optimizers[0].state_dict())
    fp8 = dict(run.precision_plugin.fp8_modules()) if name == "FP8Precision" else {}
    data = loader(make_data(1))
    run.validate(model, data, verbose=False)
    run.test(model, data, verbose=False)
    run.predict(model, data)
    for stage in ("validate", "test", "predict"):
        assert model.seen[stage] == {(torch.bfloat16, True)}, stage
    assert_same_bits([p.detach() for p in model.parameters()], before[0])
    assert all(a is b for a, b in zip(model.parameters(), before[1], strict=True))
    assert [p.dtype for p in model.parameters()] == before[2]
    assert_same_bits(run.optimizers[0].state_dict(), before[3])
    if fp8:  # the fp8 layers are fp8 again
        assert {k: type(v) for k, v in run.precision_plugin.fp8_modules().items()} == {k: type(v) for k, v in
                                                                                       fp8.items()}


@pytest.mark.parametrize("name", TRUE)
def test_a_true_plugin_converts_the_evaluation_batch_to_fp32_not_through_16_bits(name):
    """Lightning's evaluation loop converts the batch before the step's context: the plugin knows the Trainer
    evaluates and widens instead of rounding an fp32 batch to 16 bits first."""
    model, run = _fit(_plugin(name, "32-true"))
    x = torch.full((8, 16), 1.0 + 2.0**-12)  # not representable in bf16 or fp16
    batches = torch.utils.data.DataLoader([(x, torch.zeros(8, dtype=torch.long))], batch_size=None)
    (predicted,) = run.predict(model, batches)
    with torch.no_grad():
        reference = make_net()  # the same weights, widened: the fp32 model
        reference.load_state_dict({k: v.float() for k, v in model.net.state_dict().items()})
        expected = reference(x)
    assert torch.equal(predicted, expected)
    assert all(p.dtype == RUNNABLE[name][2] for p in model.parameters())


def test_eval_precision_adds_no_op_to_a_training_step():
    counts = {}
    for name in ("BF16MixedPrecision", "BF16TruePrecision"):
        for setting in (None, "32-true"):
            per_step = StepOps()
            run = trainer(_plugin(name, setting), max_steps=3, callbacks=[per_step], val_check_interval=1,
                          limit_val_batches=1)
            data = loader(make_data(3))
            run.fit(LitNet(), data, data)
            counts[name, setting] = per_step.counts
        assert counts[name, "32-true"] == counts[name, None], name
    assert counts["BF16MixedPrecision", None][0][0] > 0  # the counter counts


def _every_plugin_class() -> list[type]:
    return [getattr(module, name) for module in (lp, lpf)
            for name in (*RUNNABLE, "NVFP4Precision")]


@pytest.mark.parametrize("cls", _every_plugin_class(), ids=lambda c: f"{c.__module__.split('.')[1]}.{c.__name__}")
def test_every_plugin_takes_the_precisions_of_its_kind_and_refuses_others(cls, monkeypatch):
    te_standin.install(monkeypatch)  # NVFP4Precision's Transformer Engine, which needs CUDA: its stand-in
    kwargs = dict(RUNNABLE.get(cls.__name__, (cls, {}, None))[1])
    allowed = ("32-true",) if cls.__name__ in TRUE else ("32-true", "bf16-mixed", "16-mixed")
    assert cls.eval_precisions == allowed
    for value in (None, *allowed):
        assert cls(**kwargs, eval_precision=value).eval_precision == value
    for wrong in ("bf16-true", "fp32", 32, "16-mixed" if cls.__name__ in TRUE else "transformer-engine"):
        with pytest.raises(ValueError, match=rf"`{cls.__name__}\(eval_precision={wrong!r}\)`: pass '32-true'.* or"
                                             r" None \(the default: evaluate as it trains\)"):
            cls(**kwargs, eval_precision=wrong)
