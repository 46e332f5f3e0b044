"""The ``lightning-precision`` command line: ``fit`` (LightningCLI over the recipes), ``compare``, ``doctor``,
``plan``."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from lightning_precision.cli.console import say

__all__ = ["main", "recipe_configs"]

_USAGE = """usage: lightning-precision [--version] {fit,compare,doctor,plan} ...

  fit      LightningCLI over the recipes: lightning-precision fit --config distilbert [--config precision-16-mixed]
  compare  a recipe or your own model under several precisions, side by side (an embedded default with no arguments)
  doctor   what this machine can do: devices, packages, support per precision, recommendation
  plan     fp8 numerics per linear layer on a recipe, and the plan FP8Precision(layers=...) applies

Each command has --help.
"""


def _version_line() -> str:
    """From package metadata: importing torch and Lightning takes seconds (tests/cli/test_cli.py checks neither is)."""
    from lightning_precision import __version__
    from lightning_precision._imports import installed_version

    torch, lightning = (installed_version(name) or "not installed" for name in ("torch", "lightning"))
    return f"lightning-precision {__version__} (torch {torch}, lightning {lightning})"


class _ConfigError(Exception):
    """A constructor of ours rejected a value from the configuration: one line for the user, exit code 2."""


def _our_message(text: str) -> str | None:
    """The line of a jsonargparse error that is one of our constructors' messages (they start with the call they
    reject, e.g. "`FP16MixedPrecision(init_scale=-1.0)` is invalid: ..."): jsonargparse keeps only their text."""
    import lightning_precision
    import lightning_precision.callbacks

    names = {*lightning_precision.__all__, *lightning_precision.callbacks.__all__}
    for line in text.splitlines():
        line = line.strip().lstrip("- ").strip()
        if any(line.startswith(f"`{name}(") for name in names):
            return line
    return None


def recipe_configs() -> dict[str, Path]:
    """The recipe YAML configs by name (``"vit"``, ``"precision-bf16-mixed"``, ...), from beside the code that runs: a
    wheel ships them as ``lightning_precision/recipe_configs/``; a checkout (an editable install, or the source on
    ``PYTHONPATH``) holds the one copy in its top-level ``recipes/``, which pyproject.toml maps into the wheel."""
    from importlib.resources import files

    shipped = files("lightning_precision") / "recipe_configs"
    folder = Path(str(shipped)) if shipped.is_dir() else Path(__file__).resolve().parents[2] / "recipes"
    return {path.stem: path for path in sorted(folder.glob("*.yaml"))}


def _config_names() -> str:
    names = recipe_configs()
    recipes = [n for n in names if not n.startswith("precision-")]
    return f"recipes {', '.join(recipes)}; precisions {', '.join(n for n in names if n not in recipes)}"


def _resolve_configs(argv: list[str]) -> list[str]:
    """``--config NAME`` (or ``-c NAME``, ``--config=NAME``) of a shipped recipe config becomes its path; an existing
    file keeps precedence, and a value that is neither is refused here, naming the configs there are."""
    configs = recipe_configs()
    out = []
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            prefix, value = "--config=", arg.partition("=")[2]
        elif i and argv[i - 1] in ("-c", "--config"):
            prefix, value = "", arg
        else:
            out.append(arg)
            continue
        # jsonargparse also takes the configuration itself ("{trainer: {max_steps: 5}}"): passed on as it is.
        if not Path(value).is_file() and not any(c in value for c in ":{\n"):
            name = value.removesuffix(".yaml")
            if name not in configs:
                stem = Path(name).name
                fix = (f"the config of that name shipped with lightning-precision is `--config {stem}`"
                       if stem in configs else
                       f"name a YAML file or a config shipped with lightning-precision ({_config_names()})")
                raise _ConfigError(f"--config {value}: no such file; {fix}.")
            value = str(configs[name])
        out.append(prefix + value)
    return out


# What jsonargparse says when no configuration names a model or data, and the fix: a precision config sets neither.
_NEEDS_A_RECIPE = ("(a precision config sets only the precision: combine it with a recipe config, e.g. `--config"
                   " distilbert --config precision-bf16-mixed`, or name --model and --data)")


def _what_fit_takes() -> str:
    """``fit`` named no model (no argument, or no config): what it takes, with a command that runs as it is."""
    return ("fit trains a model on its data, both named by a config: a recipe shipped with lightning-precision"
            " (`lightning-precision fit --config distilbert --precision bf16-mixed`; "
            f"{_config_names()}), a LightningCLI YAML file of your own, or --model and --data")


# Lines of jsonargparse's union errors that say nothing to a user (the subtypes tried, the None alternative).
_NOISE = ("Subtypes:", "Errors:", "Given value", "- Expected a <class 'NoneType'>")


def _names_a_config(argv: list[str]) -> bool:
    return any(arg in ("-c", "--config") or arg.startswith("--config=") for arg in argv)


def _parser_error(message: str, argv: list[str]) -> str:
    """jsonargparse's error (several lines for a bad value of a class) as one line, with the fix where we know it."""
    text = ""
    for line in (line.strip() for line in message.splitlines()):
        if line and not line.startswith(_NOISE):
            text += (" " if text.endswith(":") else "; " if text else "") + line
    missing = re.search(r"the following arguments are required: (.*)", text)
    if missing and {"model", "data"} & {name.strip() for name in missing.group(1).split(",")}:
        # a config that names no model is a precision config; with none at all, the user has yet to learn what fit takes
        text = f"{text} {_NEEDS_A_RECIPE}" if _names_a_config(argv) else f"{text}; {_what_fit_takes()}"
    return text


# `fit --precision NAME`: the plugin it puts in `trainer.plugins` (class path, init args), the names of the
# precision-*.yaml configs.
_FIT_PRECISIONS = {
    "32-true": None,
    "bf16-mixed": ("lightning_precision.BF16MixedPrecision", {}),
    "bf16-true": ("lightning_precision.BF16TruePrecision", {}),
    "16-mixed": ("lightning_precision.FP16MixedPrecision", {}),
    "16-true": ("lightning_precision.FP16TruePrecision", {}),
    "fp8": ("lightning_precision.FP8Precision", {}),
    "fp8-emulated": ("lightning_precision.FP8Precision", {"emulate": True, "skip_small_layers": False}),
    "nvfp4": ("lightning_precision.NVFP4Precision", {}),
}


def _is_precision_plugin(entry: object) -> bool:
    """Whether a ``trainer.plugins`` entry of the parsed configuration (an object, a class path, or a class path with
    init args) is a precision plugin."""
    import importlib

    from lightning.pytorch.plugins.precision import Precision

    if isinstance(entry, Precision):
        return True
    path = entry if isinstance(entry, str) else getattr(entry, "class_path", None)
    if not isinstance(path, str):
        return False
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return False
    return isinstance(cls, type) and issubclass(cls, Precision)


def _choose_precision(config: Any, precision: str | None) -> None:
    """Apply ``--precision`` to the parsed configuration, or explain a ``trainer.precision`` that conflicts with the
    configuration's precision plugin (Lightning would raise deep inside the Trainer)."""
    from jsonargparse import Namespace

    trainer = config["trainer"]
    plugins = list(trainer.get("plugins") or [])
    ours = [p for p in plugins if _is_precision_plugin(p)]
    if precision is None:
        if trainer.get("precision") is not None and ours:
            name = getattr(ours[0], "class_path", str(ours[0])).rpartition(".")[2]
            raise _ConfigError(
                f"trainer.precision={trainer['precision']!r} conflicts with the precision plugin the configuration sets"
                f" ({name}): choose with `--precision {trainer['precision']}` instead, which swaps in"
                f" lightning-precision's plugin (one of {', '.join(_FIT_PRECISIONS)})."
            )
        return
    if precision in ("fp8", "nvfp4"):  # said now, not as a traceback from inside the fit
        _check_fp8_machine(precision)
    if trainer.get("precision") is not None:
        raise _ConfigError(f"--precision {precision} and trainer.precision={trainer['precision']!r} both choose the"
                           " precision: pass only --precision.")
    chosen = _FIT_PRECISIONS[precision]
    others = [p for p in plugins if not _is_precision_plugin(p)]
    if chosen is not None:
        others.append(Namespace(class_path=chosen[0], init_args=Namespace(**chosen[1])))
    trainer["plugins"] = others or None


def _check_fp8_machine(precision: str) -> None:
    """A ``_ConfigError`` where ``--precision fp8`` or ``nvfp4`` cannot run: no GPU of the compute capability it needs
    (NVFP4, no emulation: Transformer Engine on a Blackwell GPU), or no Transformer Engine for NVFP4."""
    import torch

    from lightning_precision import _imports
    from lightning_precision.fp8._hardware import FP8_MIN_CAPABILITY, MXFP8_MIN_CAPABILITY

    need = FP8_MIN_CAPABILITY if precision == "fp8" else MXFP8_MIN_CAPABILITY
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= need):
        instead = ("use --precision fp8-emulated to run its numerics emulated here" if precision == "fp8" else
                   "NVFP4 has no emulation: --precision bf16-mixed trains here, and GradientUnderflowMonitor(formats="
                   "['nvfp4']) measures what NVFP4 would lose")
        raise _ConfigError(f"--precision {precision} needs a CUDA GPU of compute capability >= {need[0]}.{need[1]};"
                           f" {instead}.")
    if precision == "nvfp4" and not _imports.TRANSFORMER_ENGINE_AVAILABLE:
        raise _ConfigError(f"--precision nvfp4 runs through Transformer Engine, not installed here: install it with"
                           f" `{_imports.install_command('transformer-engine')}`.")


def _fit_error(message: str) -> int:
    say(f"lightning-precision fit: error: {message.rstrip('.')}; `lightning-precision fit --help` lists the options")
    return 2


def _precision_help() -> str:
    """``--precision``'s help: what each name puts in ``trainer.plugins``, from ``_FIT_PRECISIONS``."""
    default = "none (Lightning's default, fp32)"
    built = [f"{name}: {default if chosen is None else _call(*chosen)}" for name, chosen in _FIT_PRECISIONS.items()]
    return ("train in this precision with lightning-precision's plugin, replacing the one the configuration sets"
            f" (null: keep the configuration's). The plugin each puts in trainer.plugins: {'; '.join(built)}")


def _call(class_path: str, init_args: dict[str, Any]) -> str:
    return f"{class_path.rpartition('.')[2]}({', '.join(f'{k}={v!r}' for k, v in init_args.items())})"


def _fit(argv: list[str]) -> int:
    if not argv:  # said before Lightning's seconds of imports
        return _fit_error(_what_fit_takes())
    from argparse import ArgumentError

    from lightning.pytorch.cli import LightningCLI

    from lightning_precision._warnings import ignore_known_harmless

    ignore_known_harmless()

    class CLI(LightningCLI):
        def add_arguments_to_parser(self, parser) -> None:
            parser.add_argument("--precision", choices=list(_FIT_PRECISIONS), default=None, help=_precision_help())
            parser.add_argument("--ckpt_path", default=None, help="checkpoint to resume from")

        def before_instantiate_classes(self) -> None:
            _choose_precision(self.config, self.config.get("precision"))

        def instantiate_classes(self) -> None:
            try:
                super().instantiate_classes()
            except ValueError as err:  # only construction: an error while training keeps its traceback
                message = _our_message(str(err))
                if message is None:
                    raise
                raise _ConfigError(message) from err

    argv0, sys.argv = sys.argv, sys.argv[:1]  # arguments come from `args`; LightningCLI warns if sys.argv has them too
    try:
        # run=False: the parser is `fit`'s alone, so `--help` lists exactly what this command accepts.
        # exit_on_error=False: an error is one line of ours, not under jsonargparse's ~50 lines of usage.
        cli = CLI(subclass_mode_model=True, subclass_mode_data=True, args=_resolve_configs(argv), run=False,
                  parser_kwargs={"prog": "lightning-precision fit", "exit_on_error": False,
                                 "description": "LightningCLI over the recipes. --config takes a file or the name of"
                                                f" a config shipped with lightning-precision ({_config_names()});"
                                                " several combine, later ones override, and --print_config shows the"
                                                " result: lightning-precision fit --config vit"
                                                " [--config precision-16-mixed | --precision bf16-mixed]"},
                  save_config_kwargs={"overwrite": True})
    except (_ConfigError, ArgumentError) as err:
        return _fit_error(str(err) if isinstance(err, _ConfigError) else _parser_error(str(err), argv))
    finally:
        sys.argv = argv0
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=cli.config.get("ckpt_path"))
    return 0


_COMMANDS = ("fit", "compare", "doctor", "plan")


def _missing_extra(command: str) -> str | None:
    """One line naming what this install lacks for ``command`` and the one install line that adds it; None when the
    `cli` extra is installed. A plugin or callback user installs the package without it."""
    from lightning_precision._imports import install_command, missing_cli_requirements

    missing = missing_cli_requirements()
    if not missing:
        return None
    return (f"lightning-precision {command}: the command line needs {', '.join(missing)}, not installed here."
            f" Install it with `{install_command('rich')}`.")


def _compare(argv: list[str]) -> int:
    """``compare``, with SIGINT, SIGTERM and SIGHUP taken before the imports: torch and Lightning take seconds to
    import, and a Ctrl-C then printed a traceback, or vanished where SIGINT was ignored at start (a job started with
    ``&``) and the whole comparison ran."""
    from lightning_precision.cli.spawn import exit_if_importing_main
    from lightning_precision.cli.stop import Interrupted, Stop

    exit_if_importing_main()  # a process of a comparison importing a script that lacks the __main__ guard: ends here
    with Stop() as stop:
        try:
            with stop.raising():
                from lightning_precision.cli.compare.main import UsageError
                from lightning_precision.cli.compare.main import main as compare
        except Interrupted:
            say(stop.nothing_written())
            return stop.exit_code(1)
        try:
            return compare(argv, stop)
        except UsageError as err:
            say(f"lightning-precision compare: error: {err}")
            return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(_version_line())
        return 0
    command, rest = argv[0], argv[1:]
    if command in _COMMANDS and (missing := _missing_extra(command)):
        say(missing)
        return 1
    try:
        if command == "fit":
            return _fit(rest)
        if command == "compare":
            return _compare(rest)
        if command == "doctor":
            from lightning_precision.cli.doctor import main as doctor

            return doctor(rest)
        if command == "plan":
            from lightning_precision.cli.plan import main as plan

            return plan(rest)
    except SystemExit as exit:  # argparse's --help (0) and usage errors (2): a code, also when called as a function
        return exit.code if isinstance(exit.code, int) else 1
    say(f"lightning-precision: unknown command {command!r}\n\n{_USAGE}")
    return 2


