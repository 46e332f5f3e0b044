"""The user's own model in ``lightning-precision compare``: ``--model``/``--data`` class paths (with ``--model-args``
and ``--data-args``) or a LightningCLI-style ``--config``, resolved and checked before any training, built alike in
every precision's process, and measured once before the runs (samples per batch, FLOPs per step) as a recipe is."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ClassSpec", "ModelError", "UserModel", "build", "first_dim", "from_args", "measure_batch", "step_loss",
           "validates"]

# Top-level keys of a LightningCLI config that name what to train; every other one (trainer, seed_everything,
# optimizer, ckpt_path, ...) is said to be ignored: compare sets the Trainer and the seed of each precision's run.
_TRAINED = ("model", "data")


class ModelError(ValueError):
    """The user's model or data cannot be used: one line naming the option, the class and the fix (exit code 2)."""


@dataclass(frozen=True)
class ClassSpec:
    """A class to build: its import path, its init args, and the options that named them (for the messages)."""

    path: str
    init_args: Mapping[str, Any] = field(default_factory=dict)
    named_by: str = "--model"  # "--model", or "model.class_path in cfg.yaml"
    args_from: str = "--model-args"  # "--model-args", or "model.init_args in cfg.yaml"

    @property
    def name(self) -> str:
        return self.path.rpartition(".")[2]

    def call(self) -> str:
        """The constructor call as written: ``pkg.Net(hidden=64)``."""
        return f"{self.path}({', '.join(f'{k}={v!r}' for k, v in self.init_args.items())})"


@dataclass(frozen=True)
class UserModel:
    """What ``compare`` trains instead of a recipe: plain strings and JSON values, so it travels to every precision's
    process, which imports the classes itself."""

    model: ClassSpec
    data: ClassSpec
    cwd: str  # importable, as for ``python -m``: first on sys.path, in the parent and in each process
    config: str | None = None
    ignored: tuple[str, ...] = ()  # the config's other top-level keys

    @property
    def label(self) -> str:
        """The model's class name: the progress lines' and the table's title."""
        return self.model.name

    def describe(self) -> str:
        return f"{self.model.call()} on {self.data.call()}"

    def notes(self) -> list[str]:
        """Said before the runs and under the table."""
        if not self.ignored:
            return []
        keys = ", ".join(f"{k}:" for k in self.ignored)
        return [f"--config {self.config}: {keys} ignored: compare runs its own Trainer for each precision (--steps,"
                " --seed, --accelerator), and the model's configure_optimizers."]


@contextlib.contextmanager
def _importable(cwd: str) -> Iterator[None]:
    """``cwd`` first on sys.path while the user's classes are imported here, as ``python -m`` has it; the caller's
    sys.path as it was afterwards."""
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _import(spec: ClassSpec, cwd: str) -> Any:
    module_name, _, attr = spec.path.rpartition(".")
    if not module_name or not attr:
        raise ModelError(f"{spec.named_by} {spec.path}: give the class's full import path, module.Class (e.g."
                         f" my_pkg.models.{spec.path or 'Net'})")
    with _importable(cwd):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            missing = err.name or module_name
            raise ModelError(f"{spec.named_by} {spec.path}: no module named {missing!r} (the current directory is"
                             f" {cwd}; is the package installed?)") from None
        except Exception as err:  # the user's module raised as it was imported
            raise ModelError(f"{spec.named_by} {spec.path}: importing {module_name} raised {type(err).__name__}:"
                             f" {_line(err)}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ModelError(f"{spec.named_by} {spec.path}: module {module_name!r} ({getattr(module, '__file__', '?')})"
                         f" has no attribute {attr!r}") from None


def _line(err: object) -> str:
    return " ".join(str(err).split())


def _check_class(cls: Any, spec: ClassSpec, base: type, kind: str, needs: tuple[str, ...]) -> None:
    """``cls`` is a subclass of ``base`` that overrides each of ``needs`` (the Trainer refuses a fit without them)."""
    from lightning_utilities.core.overrides import is_overridden

    if not isinstance(cls, type):
        raise ModelError(f"{spec.named_by} {spec.path} is not a class but a {type(cls).__name__}: name a {kind}"
                         " subclass")
    if not issubclass(cls, base):
        bases = ", ".join(b.__name__ for b in cls.__mro__[1:-1]) or "object"
        raise ModelError(f"{spec.named_by} {spec.path} is not a {kind} (its bases: {bases}): compare trains with"
                         f" Lightning's Trainer, which takes a {kind}")
    missing = [name for name in needs if not is_overridden(name, cls, base)]
    if missing:
        raise ModelError(f"{spec.named_by} {spec.path} defines no {', '.join(f'{m}()' for m in missing)}, which the"
                         " Trainer needs to train it")


def _init_args(text: str | None, option: str) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ModelError(f"{option} {text!r} is not JSON ({err}): give an object, e.g. {option}"
                         " '{\"hidden\": 64}'") from None
    if not isinstance(value, dict):
        raise ModelError(f"{option} {text!r} is a JSON {type(value).__name__}: give an object of init args, e.g."
                         f" {option} '{{\"hidden\": 64}}'")
    return value


def _read_config(path: str) -> dict[str, Any]:
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ModelError(f"--config {path}: cannot read it ({err.strerror or err})") from None
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(err, "problem", None) or _line(err)
        raise ModelError(f"--config {path}: not valid YAML: {where}{problem}") from None
    if not isinstance(config, dict):
        raise ModelError(f"--config {path}: expected a mapping with model: and data: (LightningCLI's format), not a"
                         f" {type(config).__name__}")
    return config


def _config_entry(config: dict[str, Any], key: str, path: str) -> ClassSpec:
    """``model:``/``data:`` as LightningCLI takes them: ``{class_path, init_args}``, ``{class_path}`` or the class
    path alone."""
    entry = config.get(key)
    named_by, args_from = f"{key}.class_path in {path}", f"{key}.init_args in {path}"
    if entry is None:
        example = "my_pkg.Data" if key == "data" else "my_pkg.Net"
        raise ModelError(f"--config {path} sets no {key}: (add `{key}: {{class_path: {example}, init_args: {{...}}}}`)")
    if isinstance(entry, str):
        return ClassSpec(entry, {}, named_by, args_from)
    if not isinstance(entry, dict) or not isinstance(entry.get("class_path"), str):
        raise ModelError(f"--config {path}: {key}: needs a class_path (`{key}: {{class_path: module.Class, init_args:"
                         " {...}}`)")
    others = sorted(set(entry) - {"class_path", "init_args"})
    if others:
        raise ModelError(f"--config {path}: {key}: has {', '.join(others)} beside class_path: init args go under"
                         f" {key}.init_args")
    init_args = entry.get("init_args") or {}
    if not isinstance(init_args, dict):
        raise ModelError(f"--config {path}: {key}.init_args is a {type(init_args).__name__}, not a mapping")
    return ClassSpec(entry["class_path"], init_args, named_by, args_from)


def from_args(args: Any) -> UserModel | None:
    """The user's model named by the parsed arguments (``--model``/``--data``/``--model-args``/``--data-args``,
    ``--config``), imported and checked here; None when they name none (a recipe runs)."""
    given = [o for o, v in (("--model", args.model), ("--data", args.data), ("--model-args", args.model_args),
                            ("--data-args", args.data_args), ("--config", args.config)) if v is not None]
    if not given:
        return None
    if args.recipe is not None:
        raise ModelError(f"--recipe and {given[0]} both say what to train: pass --recipe for a recipe, or --model and"
                         " --data (or --config) for your own model")
    for option, value in (("--data-dir", args.data_dir), ("--batch-size", args.batch_size)):
        if value is not None:
            raise ModelError(f"{option} is a recipe's: with {given[0]} your data class takes its own arguments (pass"
                             " them in --data-args or the config's data.init_args)")
    size = getattr(args, "size", "auto")
    if size != "auto":  # before the user's modules are imported: nothing of theirs runs for a refused command
        raise ModelError(f"--size {size}: the recipes' sizes; your own model runs as its data makes it")
    cwd = os.getcwd()
    if args.config is not None:
        if args.model is not None or args.data is not None or args.model_args or args.data_args:
            raise ModelError(f"--config and {next(o for o in given if o != '--config')} both name the model: pass"
                             " --config alone, or --model and --data")
        config = _read_config(args.config)
        spec = UserModel(_config_entry(config, "model", args.config), _config_entry(config, "data", args.config), cwd,
                         args.config, tuple(k for k in config if k not in _TRAINED))
    else:
        if args.model is None or args.data is None:
            missing = "--data" if args.model is not None else "--model"
            raise ModelError(f"{given[0]} needs {missing}: compare trains --model pkg.Net on --data pkg.Data (a"
                             " LightningModule and a LightningDataModule), or the two from --config")
        spec = UserModel(ClassSpec(args.model, _init_args(args.model_args, "--model-args")),
                         ClassSpec(args.data, _init_args(args.data_args, "--data-args"), "--data", "--data-args"),
                         cwd)
    _classes(spec)
    return spec


def _classes(spec: UserModel) -> tuple[type, type]:
    import lightning as L

    model, data = _import(spec.model, spec.cwd), _import(spec.data, spec.cwd)
    _check_class(model, spec.model, L.LightningModule, "LightningModule", ("training_step", "configure_optimizers"))
    _check_class(data, spec.data, L.LightningDataModule, "LightningDataModule", ("train_dataloader",))
    return model, data


def build(spec: UserModel) -> tuple[Any, Any]:
    """The model and the data module, built from their init args; a ``ModelError`` naming the call that raised."""
    if spec.cwd not in sys.path:  # a precision's process: importable for the whole run, as under ``python -m``
        sys.path.insert(0, spec.cwd)
    model_cls, data_cls = _classes(spec)
    built = []
    for cls, part in ((model_cls, spec.model), (data_cls, spec.data)):
        try:
            built.append(cls(**part.init_args))
        except Exception as err:
            raise ModelError(f"{part.named_by} {part.path}: {part.call()} raised {type(err).__name__}: {_line(err)}"
                             f" (init args from {part.args_from})") from None
    return built[0], built[1]


def validates(model: Any, data: Any) -> bool:
    """Whether a validation pass can run: the model has a validation_step and the data (or the model) a loader."""
    import lightning as L
    from lightning_utilities.core.overrides import is_overridden

    return is_overridden("validation_step", model, L.LightningModule) and (
        is_overridden("val_dataloader", data, L.LightningDataModule)
        or is_overridden("val_dataloader", model, L.LightningModule))


def first_dim(batch: Any) -> int | None:
    """Samples in a batch: the first dim of its first tensor (a tensor, a list or tuple, a mapping's first value)."""
    import torch

    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else None
    if isinstance(batch, (list, tuple)) and batch:
        return first_dim(batch[0])
    if isinstance(batch, Mapping) and batch:
        return first_dim(next(iter(batch.values())))
    return None


def step_loss(model: Any, batch: Any) -> Any:
    """The loss of ``model.training_step(batch, 0)`` outside a Trainer (its ``self.log`` calls do nothing there): what
    the FLOPs per step are counted on."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "You are trying to `self.log()` but the `self.trainer` reference ..."
        out = model.training_step(batch, 0)
    if getattr(model, "automatic_optimization", True) and (out is None or (isinstance(out, Mapping)
                                                                            and "loss" not in out)):
        # the Trainer skips the step (None) or raises in every precision (a dict without 'loss'); under manual
        # optimization the step steps the optimizer itself and may return nothing
        what = "None" if out is None else f"a dict without 'loss' (keys: {', '.join(map(str, out)) or 'none'})"
        raise ModelError(f"{type(model).__name__}.training_step returned {what}: nothing would train; return the loss"
                         " (or a dict with 'loss')")
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise ValueError(f"training_step returned {type(out).__name__}, not a loss tensor that requires grad")
    return loss


def measure_batch(spec: UserModel, seed: int) -> dict[str, Any]:
    """What one training batch holds and costs, the same for every precision, measured once before the runs (as
    ``main.measure_batch`` does for a recipe): ``batch_size`` (its first dim), ``model_flops_per_step`` (forward and
    backward of ``training_step``'s loss in fp32 on the CPU; None, with ``flops_note`` saying why, where it cannot be
    counted). A ``ModelError`` where the model or the data cannot be built, or the data gives no batch: every
    precision's run would fail."""
    with _importable(spec.cwd):  # the user's modules may import others lazily, in a step
        return _measure(spec, seed)


def _measure(spec: UserModel, seed: int) -> dict[str, Any]:
    import lightning as L

    from lightning_precision._mfu import model_flops_per_step

    L.seed_everything(seed, verbose=False)
    model, data = build(spec)
    empty = object()
    try:
        data.prepare_data()
        data.setup("fit")
        batch = next(iter(data.train_dataloader()), empty)
    except Exception as err:
        raise ModelError(f"{spec.data.named_by} {spec.data.path}: its first training batch cannot be made"
                         f" ({type(err).__name__}: {_line(err)}), so every precision would fail") from None
    if batch is empty:
        raise ModelError(f"{spec.data.named_by} {spec.data.path}: train_dataloader() yields no batch (it is empty),"
                         " so every precision would fail")
    out: dict[str, Any] = {"batch_size": first_dim(batch), "unit": None, "units_per_batch": None,
                           "model_flops_per_step": None}
    try:
        model.configure_model()
        out["model_flops_per_step"] = model_flops_per_step(model, batch, step_loss)
    except ModelError as err:  # a step that returns no loss: every precision's run would train nothing or fail
        raise ModelError(f"{spec.model.named_by} {spec.model.path}: {err}") from None
    except Exception as err:  # a step that needs the Trainer (self.trainer, manual optimization): MFU is n/a
        out["flops_note"] = (f"MFU: n/a: {spec.model.name}'s FLOPs per step could not be counted on its"
                             f" training_step outside a Trainer ({type(err).__name__}: {_line(err)}).")
    return out
