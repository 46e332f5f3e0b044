"""The ``lightning-precision`` command line: ``fit`` (LightningCLI over the recipes), ``compare``, ``doctor``."""

from __future__ import annotations

import sys
from typing import Optional

USAGE = """usage: lightning-precision {fit,compare,doctor} ...

  fit      LightningCLI over the recipes: lightning-precision fit --config recipes/distilbert.yaml
  compare  one recipe under several precisions, side by side (runs an embedded default with no arguments)
  doctor   what this machine can do: devices, packages, support per precision, recommendation
"""


class _ConfigError(Exception):
    """A constructor of ours rejected a value from the configuration: one line for the user, exit code 2."""


def _our_message(text: str) -> Optional[str]:
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


def _fit(argv: list[str]) -> int:
    from lightning.pytorch.cli import LightningCLI

    class CLI(LightningCLI):
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
        CLI(subclass_mode_model=True, subclass_mode_data=True, args=["fit", *argv], save_config_kwargs={"overwrite": True})
    except _ConfigError as err:
        print(f"lightning-precision fit: error: {err}", file=sys.stderr)
        return 2
    finally:
        sys.argv = argv0
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "fit":
        return _fit(rest)
    if command == "compare":
        from lightning_precision.compare import UsageError
        from lightning_precision.compare import main as compare

        try:
            return compare(rest)
        except UsageError as err:
            print(f"lightning-precision compare: error: {err}", file=sys.stderr)
            return 2
    if command == "doctor":
        from lightning_precision.doctor import main as doctor

        return doctor(rest)
    print(f"lightning-precision: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
