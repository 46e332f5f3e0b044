"""An output folder that holds one run's set of files and nothing else: held by one run at a time, replaced whole.

``claim_folder`` takes the folder's lock for the whole run (a second run on the same folder is refused instead of
deleting the first one's files) and refuses a folder holding anything that is not one of the set's files: those are
the user's, and the folder is replaced whole. ``replace_folder`` writes the set to a sibling temporary folder and swaps
it in, so the folder holds one whole set, the old or the new, whatever happens during the writes (a full disk, a
kill). ``lightning-precision compare``'s report folder."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import shutil
import sys
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

from lightning_precision._io import check_writable_dir

__all__ = ["claim_folder", "exchange", "replace_folder"]

_NEW, _OLD = ".new-", ".old-"  # the sibling temporary folders: ".<name>.new-XXXX", ".<name>.old-XXXX"


def _resolve(path: str | os.PathLike[str], owner: str) -> Path:
    """The real folder (a symbolic link to a folder is followed: its target is what gets replaced)."""
    folder = Path(os.path.realpath(Path(path).expanduser()))
    if folder.parent == folder:
        raise ValueError(f"{owner}: {str(path)!r} is the root folder, which cannot be replaced; name a folder to write"
                         " into.")
    cwd = Path(os.path.realpath(os.getcwd()))
    if cwd == folder or folder in cwd.parents:
        raise ValueError(f"{owner}: {str(path)!r} holds the current folder, which the report would replace; name a"
                         " folder of its own, e.g. compare-report.")
    return folder


def _sibling(folder: Path, tag: str) -> str:
    return f".{folder.name}{tag}"


def _new_folder(parent: Path, prefix: str) -> Path:
    """A new empty folder of a unique name, with the usual permissions (``tempfile.mkdtemp`` makes it private)."""
    while True:
        path = parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue


def _foreign(folder: Path, names: Collection[str], strict: bool = True) -> list[str]:
    """What the folder holds besides the set's files (shown with a ``/`` if a folder). ``strict``: a folder under one of
    the set's names counts too (it cannot be one of its files, and is not deleted as one)."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    return [e.name + ("/" if e.is_dir(follow_symlinks=False) else "") for e in entries
            if e.name not in names or (strict and e.is_dir(follow_symlinks=False))]


def _remove_set(folder: Path, names: Collection[str]) -> bool:
    """Delete the set's files from ``folder`` and the folder itself if that empties it; False if something else is in
    it (left as it is)."""
    for name in names:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
            (folder / name).unlink()
    try:
        folder.rmdir()
    except OSError:
        return False
    return True


def _holder(fd: int) -> str:
    """The pid the holder of a lock file wrote in it ("" if unreadable)."""
    try:
        return os.read(fd, 32).decode(errors="replace").strip()
    except OSError:
        return ""


def _held_above(folder: Path) -> tuple[Path, str] | None:
    """The folder above ``folder`` that another run holds, with its holder's pid: that run replaces it whole, and would
    find this run's folder and lock in it. None if none (or where the system has no ``flock``)."""
    try:
        import fcntl
    except ImportError:
        return None
    for above in folder.parents:
        if above.parent == above:
            break
        try:
            fd = os.open(above.parent / f"{_sibling(above, '')}.lock", os.O_RDONLY)
        except OSError:  # no lock file: no run holds it
            continue
        try:
            # A shared lock, released at once: refused while a run holds the exclusive one. (A run claiming that very
            # folder in the same instant would be refused once, as if held.)
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                return above, _holder(fd)
        finally:
            os.close(fd)
    return None


def _open_made(path: Path, tries: int = 100) -> int:
    """Open (create) the file ``path``, making its folder and parents first. A run on a sibling folder that made the
    same parents removes them as it leaves having written nothing (``claim_folder``), possibly between the making and
    the opening: they are made again."""
    for _ in range(tries - 1):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            continue
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)


@contextlib.contextmanager
def _lock(folder: Path, owner: str) -> Iterator[None]:
    """Hold ``.<name>.lock`` beside the folder (beside it, not in it: the folder itself is swapped). ``flock`` ends
    with the process, so a killed run leaves no lock that blocks the next one; the file is removed on release, and a
    run that locked a file just removed (the unlink race) tries again on the new one."""
    path = folder.parent / f"{_sibling(folder, '')}.lock"
    try:
        import fcntl
    except ImportError:  # Windows: msvcrt's lock of the file's first byte, released on close
        fcntl = None  # type: ignore[assignment]
    while True:
        try:
            fd = _open_made(path)
        except OSError as err:
            check_writable_dir(folder, owner)  # the words every writer uses when it is the folder that cannot be made
            raise ValueError(f"{owner}: cannot create the lock file {str(path)!r} beside the folder"
                             f" ({err.strerror or err}); choose a folder in a writable place.") from None
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            else:
                import msvcrt

                msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                os.close(fd)
                raise
            holder = _holder(fd)
            os.close(fd)
            by = f" (pid {holder})" if holder else ""
            raise ValueError(f"{owner}: {str(folder)!r} is in use by another run{by}; wait for it to finish or choose"
                             " another folder.") from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # its holder removed it between our open and our lock: lock the file that is there now
    try:
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        if fcntl is not None:  # removed while still locked, so no run can lock this file after it is gone
            with contextlib.suppress(OSError):
                os.unlink(path)
        os.close(fd)


def _recover(folder: Path, names: Collection[str]) -> None:
    """Clear what a killed run left beside the folder (the lock is held: no other run is writing). A ``.new-`` folder
    is an unfinished new set, or an old one already replaced: the folder holds a whole set either way. An ``.old-``
    folder is the previous set, moved aside by a swap made in two steps (``replace_folder`` where the system has no
    exchange) and cut short before the new one was moved in: it goes back if the folder is missing or empty. A
    temporary folder holding anything but the set's files is left alone."""
    prefix = _sibling(folder, "")
    for name in sorted(os.listdir(folder.parent)):
        entry, tag = folder.parent / name, name[len(prefix):]
        if not name.startswith(prefix) or not tag.startswith((_NEW, _OLD)) or entry.is_symlink() or \
                not entry.is_dir() or _foreign(entry, names):
            continue
        if tag.startswith(_OLD) and (not folder.exists() or (folder.is_dir() and not any(folder.iterdir()))):
            with contextlib.suppress(FileNotFoundError):
                folder.rmdir()
            os.rename(entry, folder)
        else:
            _remove_set(entry, names)


@contextlib.contextmanager
def claim_folder(path: str | os.PathLike[str], owner: str, names: Collection[str]) -> Iterator[Path]:
    """Hold the folder ``path`` for this run, released on every way out (and by the system if the process is killed);
    yields its real path. A ``ValueError`` naming ``owner``, the folder and the fix if another run holds it, or if it
    holds a file not named in ``names``: the folder is replaced whole later (``replace_folder``), and the user's files
    are never moved or deleted. The folder need not exist: it is made, and a file written in it to prove it can be;
    if it is still empty on the way out (nothing was written), it is removed again, with the parents made for it."""
    if str(path) == "":
        check_writable_dir(path, owner)  # refused, in the words every writer uses
    folder = _resolve(path, owner)
    held = _held_above(folder)
    if held is not None:
        above, holder = held
        by = f" (pid {holder})" if holder else ""
        raise ValueError(f"{owner}: {str(path)!r} is inside {str(above)!r}, which another run{by} is writing and"
                         " replaces whole; choose a folder outside it.")
    # The folder and the parents this claim creates: a run that writes nothing (refused, interrupted) leaves none
    made = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        with _lock(folder, owner):
            try:
                _recover(folder, names)
                check_writable_dir(folder, owner)  # under the lock: no check writes into a folder another run holds
                # Names only: a folder in the place of one of the set's files fails the swap later, as a write into
                # it would.
                foreign = _foreign(folder, names, strict=False)
                if foreign:
                    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
                    raise ValueError(f"{owner}: {str(path)!r} holds {shown}, which a report does not write, and the"
                                     " folder is replaced whole by each report; choose a new or empty folder, or move"
                                     " them out.")
                yield folder
            finally:
                if made:  # still under the lock: no other run is using it
                    with contextlib.suppress(OSError):  # not empty (a report is in it), or gone
                        folder.rmdir()
    finally:
        for parent in made[1:]:  # after the lock file beside the folder is gone
            try:
                parent.rmdir()
            except OSError:
                break


def _fsync(path: Path) -> None:
    """Flush a file to disk: an error (a full disk found only now) is raised, so the set is not swapped in."""
    with open(path, "r+b") as f:  # writable: Windows flushes only a handle that may write
        os.fsync(f.fileno())


def _fsync_folder(path: Path) -> None:
    """Flush a folder's entries to disk where the system can (not on Windows, nor on every filesystem)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the system cannot, so that the
    caller moves them one after the other."""
    if sys.platform != "linux":
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # glibc < 2.28, or a C library without it
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):  # a kernel or filesystem without it
        return False
    raise OSError(code, os.strerror(code), str(b))


def replace_folder(folder: Path, names: Collection[str],
                   fill: Callable[[Path], list[str]]) -> tuple[Path, str | None]:
    """Replace ``folder`` (held with ``claim_folder``) by a new folder in which ``fill(new)`` wrote some of ``names``:
    written to a sibling temporary folder, flushed to disk, swapped in (in one step on Linux), then the old set is
    deleted. If ``fill`` raises (a full disk), the folder keeps its old set and the temporary folder is removed.

    Returns the folder that holds the new set, and a note when something is not where it was. If ``folder`` holds
    something the set does not (a file that came during the run, a folder where a file of the set goes), or cannot be
    replaced, it is left as it is and the new set is kept beside it, in a visible ``<name>.new-XXXXXXXX``."""
    tmp = _new_folder(folder.parent, _sibling(folder, _NEW))
    try:
        written = fill(tmp)
        unknown = sorted(set(written) - set(names))
        if unknown:
            raise RuntimeError(f"replace_folder: {unknown} are not files of the set {sorted(names)}")
        for name in written:
            _fsync(tmp / name)
        _fsync_folder(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        foreign = _foreign(folder, names)
        if not foreign:
            return folder, _swap(tmp, folder, names)
        why = f"{str(folder)!r} holds {', '.join(foreign[:5])}, which a report does not write: it is left as it is"
    except OSError as err:  # not swapped: the new set is a finished result, kept where it can be found
        why = f"{str(folder)!r} could not be replaced ({err}): it is left as it is"
    aside = folder.parent / tmp.name[1:]
    try:
        os.rename(tmp, aside)
    except OSError:
        aside = tmp
    return aside, f"{why}, and the report is in {str(aside)!r}"


def _swap(tmp: Path, folder: Path, names: Collection[str]) -> str | None:
    """Put ``tmp`` in the place of ``folder`` and delete the old set; ``OSError`` if nothing was swapped. A note if
    something came into the old folder in between: it is kept, named in the note."""
    if not folder.exists():
        os.rename(tmp, folder)
        _fsync_folder(folder.parent)
        return None
    os.chmod(tmp, folder.stat().st_mode & 0o7777)  # a folder the user made private stays private
    if exchange(tmp, folder):
        old = tmp
    else:  # two steps: in between, the old set waits in ".old-" (``_recover`` puts it back after a kill)
        old = folder.parent / f"{_sibling(folder, _OLD)}{tmp.name.rsplit('-', 1)[-1]}"
        os.rename(folder, old)
        try:
            os.rename(tmp, folder)
        except BaseException:
            os.rename(old, folder)
            raise
    _fsync_folder(folder.parent)
    if _remove_set(old, names):
        return None
    kept = folder.parent / f"{folder.name}.previous-{old.name.rsplit('-', 1)[-1]}"
    try:  # something came into the old folder between the check and the swap: it stays, visible
        os.rename(old, kept)
    except OSError:
        kept = old
    return f"what came into {str(folder)!r} while it was replaced is in {str(kept)!r}"
