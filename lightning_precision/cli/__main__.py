"""``python -m lightning_precision.cli``: the ``lightning-precision`` command."""

import sys

from lightning_precision.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
