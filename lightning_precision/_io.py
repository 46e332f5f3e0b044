"""Where results are written: checks made before the work that produces them, and writes that never leave a file
half-written or replace a symbolic link with a copy."""

from __future__ import annotations

import itertools
import math
import os
import tempfile
from pathlib import Path

__all__ = [
    "atomic_write_bytes",
    "atomic_write_text",
    "check_writable_dir",
    "check_writable_file",
    "create_new_file",
    "json_safe",
]


def check_writable_dir(path: str | os.PathLike[str], owner: str) -> Path:
    """Create ``path`` (and its parents) if needed and prove a file can be written in it; a ``ValueError`` naming
    ``owner`` and the reason otherwise. Called before a fit or a comparison, so a bad path costs seconds, not a run."""
    if str(path) == "":
        raise ValueError(f"{owner}: an empty path names no folder; name a folder to write into.")
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


def check_writable_file(path: str | os.PathLike[str], owner: str) -> Path:
    """Prove that ``atomic_write_text(path, ...)`` can succeed later: the folder of the file (of a symbolic link's
    target) can be written, and the path is not a folder. A ``ValueError`` naming ``owner``, the path and the fix
    otherwise. Creates the folder if needed; writes nothing at ``path`` itself."""
    if str(path) == "":
        raise ValueError(f"{owner}: an empty path names no file; name a file to write.")
    target = Path(os.path.realpath(Path(path).expanduser()))
    if target.is_dir():
        raise ValueError(f"{owner}: {str(path)!r} is a folder; name a file to write.")
    check_writable_dir(target.parent, owner)
    if target.exists() and not os.access(target, os.W_OK):
        raise ValueError(f"{owner}: {str(path)!r} exists and is read-only; choose another file or make it writable.")
    return target


def atomic_write_text(path: str | os.PathLike[str], text: str, *, follow_links: bool = True) -> Path:
    """Write ``text`` to ``path`` whole or not at all: to a uniquely named temporary file beside it, flushed to disk,
    then renamed over it. A symbolic link stays a link (its target is replaced); with ``follow_links=False`` the link
    itself is replaced and what it points to never written (a file of ours, such as a cache, where a link is nobody's
    intent). Two processes writing the same path each write their own temporary file, and one whole text wins. A new
    file gets the usual permissions (an existing one keeps its own). Returns ``path``."""
    return atomic_write_bytes(path, text.encode("utf-8"), follow_links=follow_links)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, follow_links: bool = True) -> Path:
    """``atomic_write_text`` for bytes (a plot, an archive): the same guarantees."""
    path = Path(path)
    expanded = path.expanduser()
    target = Path(os.path.realpath(expanded) if follow_links else os.path.abspath(expanded))
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        kept = target.exists() and not target.is_symlink()  # (a link not followed: its target's mode is not ours)
        os.chmod(tmp, target.stat().st_mode & 0o7777 if kept else 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def create_new_file(directory: str | os.PathLike[str], name: str) -> Path:
    """Create an empty file named ``name`` in ``directory``, or ``<stem>-1<suffix>``, ``<stem>-2<suffix>``, ... if
    that name is taken, and return its path. Created exclusively (``O_EXCL``): an existing file is never opened, let
    alone overwritten, and two processes never get the same name. For a run's default output file, which the run then
    rewrites (``atomic_write_text``) as its own."""
    stem, suffix = os.path.splitext(name)
    for i in itertools.count():
        path = Path(directory) / (name if i == 0 else f"{stem}-{i}{suffix}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        return path
    raise AssertionError("unreachable")  # itertools.count() never ends


def _umask() -> int:
    try:  # Linux says it without changing it (setting it, even back, races with other threads creating files)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def json_safe(value: object) -> object:
    """``value`` (dicts, lists, tuples, scalars) with every float that is not finite replaced by the string Python
    writes for it, ``"nan"``, ``"inf"`` or ``"-inf"`` (as the csv module and plan files write them), so that
    ``json.dumps(..., allow_nan=False)`` accepts it: strict JSON has no NaN or infinities, and most parsers other than
    Python's refuse the bare ``NaN`` that ``json.dumps`` writes by default."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
