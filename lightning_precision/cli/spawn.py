"""A script that calls ``compare`` without ``if __name__ == "__main__":``. Each precision's process is started with
multiprocessing's spawn, which imports the calling script again in the new process before it runs the process's work:
at the script's top level, that call runs again there. Multiprocessing says so only when that second call starts a
process of its own (a traceback per process), and compare's lock refused it earlier with a misleading line; so the new
process ends at once with an exit code of its own, which the parent turns into one line that names the fix."""

from __future__ import annotations

import multiprocessing
import os
import sys

__all__ = ["NO_MAIN_GUARD_EXIT", "exit_if_importing_main", "no_main_guard_message"]

NO_MAIN_GUARD_EXIT = 86  # a process that ended here; no exit code of Python's own or of the command's (0-2, 128+)


def exit_if_importing_main() -> None:
    """End this process at once if multiprocessing is still starting it, importing the calling script (what its own
    "bootstrapping phase" check, ``spawn._check_not_importing_main``, reads); return otherwise."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        os._exit(NO_MAIN_GUARD_EXIT)  # nothing of the script's second run may go on: no cleanup, no output


def no_main_guard_message() -> str:
    """The line for the user, in the parent (whose ``__main__`` is the calling script)."""
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    named = f" ({os.path.basename(script)})" if script else ""
    return (f"the script that calls compare{named} lacks `if __name__ == \"__main__\":` around the call: each"
            " precision's process imports that script again as it starts (multiprocessing's spawn), which would run"
            " the comparison again there; put the call under that guard.")
