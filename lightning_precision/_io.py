"""Checks on where results will be written, made before the work that produces them."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["check_writable_dir"]


def check_writable_dir(path: "str | os.PathLike[str]", owner: str) -> Path:
    """Create ``path`` (and its parents) if needed and prove a file can be written in it; a ``ValueError`` naming
    ``owner`` and the reason otherwise. Called before a fit or a comparison, so a bad path costs seconds, not a run."""
    directory = Path(path).expanduser()
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{owner}: {str(directory)!r} exists and is not a folder; name a folder to write into.")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-check-"):
            pass
    except OSError as err:
        raise ValueError(f"{owner}: cannot write into {str(directory)!r} ({err.strerror or err}); choose another"
                         " folder.") from None
    return directory
