"""Every optional dependency is checked here, and nowhere else.

Checks use package metadata (``RequirementCache``) so nothing is imported speculatively; the error names the pip
extra that installs the missing package (for a core dependency: reinstall); ``import_quietly`` imports one without
the log lines known to be harmless.
"""

import importlib
import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

from lightning_utilities.core.imports import RequirementCache

__all__ = [
    "CLI_REQUIREMENTS",
    "IPEX",
    "DATASETS_AVAILABLE",
    "EXTRA_OF",
    "MATPLOTLIB_AVAILABLE",
    "TORCHAO_AVAILABLE",
    "TRANSFORMERS_AVAILABLE",
    "TRANSFORMER_ENGINE_AVAILABLE",
    "import_quietly",
    "import_torchvision",
    "imports_cleanly",
    "install_command",
    "installed_version",
    "ipex_status",
    "load_ipex",
    "missing_cli_requirements",
    "quiet_known_noise",
    "require",
    "version_of",
]

# The minimums repeat pyproject.toml's extras (tests/package/test_one_table.py checks that they agree).
TORCHAO_AVAILABLE = RequirementCache("torchao>=0.11")
TRANSFORMER_ENGINE_AVAILABLE = RequirementCache("transformer-engine>=2.9")
DATASETS_AVAILABLE = RequirementCache("datasets>=2.14")
MATPLOTLIB_AVAILABLE = RequirementCache("matplotlib>=3.7")
# The command line's own needs (the `cli` extra), checked before a command runs.
TRANSFORMERS_AVAILABLE = RequirementCache("transformers>=4.40")
CLI_REQUIREMENTS = (
    RequirementCache("jsonargparse[signatures]>=4.27"),
    RequirementCache("rich>=13"),
    MATPLOTLIB_AVAILABLE,
    TRANSFORMERS_AVAILABLE,
    RequirementCache("torchmetrics>=1.4"),
)

# The pip extra of each optional package, as pyproject.toml's [project.optional-dependencies] lists it (matplotlib is
# in `cli` too: the command line draws plots). Core dependencies are in no extra and not here.
EXTRA_OF = {
    "torchao": "fp8",
    "transformer-engine": "te",
    "datasets": "recipes",
    "matplotlib": "plots",
    "transformers": "cli",
    "jsonargparse": "cli",
    "rich": "cli",
    "torchmetrics": "cli",
}

IPEX = "intel-extension-for-pytorch"


def install_command(package: str) -> str:
    """The pip command that installs an optional package: ``pip install 'lightning-precision[fp8]'``."""
    return f"pip install 'lightning-precision[{EXTRA_OF[package]}]'"


def missing_cli_requirements() -> list[str]:
    """The command line's requirements this install does not meet (``["rich>=13"]``), from package metadata: nothing
    is imported."""
    return [str(r.requirement) for r in CLI_REQUIREMENTS if not r]


def require(available: RequirementCache, package: str, feature: str) -> None:
    """Raise a ``ModuleNotFoundError`` saying how to install ``package`` when ``available`` is false: its extra, or a
    reinstall for a core dependency (whose absence means a broken install)."""
    if not available:
        remedy = (f"Install it with `{install_command(package)}`." if package in EXTRA_OF else
                  "lightning-precision depends on it, so this install is broken: reinstall lightning-precision.")
        raise ModuleNotFoundError(f"{feature} needs `{package}`, which is not installed ({available.message})."
                                  f" {remedy}")


# Log records known to be harmless, by logger. Without CUDA, torchao's CUDA kernels (`_C_mxfp8`, `_C_cutlass_90a`)
# cannot load and are never called, and it skips its C++ extensions on a torch it was not built for; on a GPU machine
# both may explain a failure, so they stay. torchao calls `register_constant` on enums, which torch >= 2.11 deprecates.
_NOISE_WITHOUT_CUDA = {
    "torchao": (r"^Failed to load .*torchao[\\/]_C[^\\/]*\.so: ",
                r"^Skipping import of cpp extensions due to incompatible torch version"),
}
_NOISE = {
    "torch.utils._pytree": (r"is an Enum subclass and is now natively supported .* Calling register_constant\(\) on"
                            r" Enum subclasses is deprecated",),
}


class _DropKnownNoise(logging.Filter):
    def __init__(self, patterns: "tuple[str, ...]") -> None:
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.search(message) for p in self.patterns)


@contextmanager
def quiet_known_noise() -> Iterator[None]:
    """Drop the log records known to be harmless here (``_NOISE``) while the block runs, for imports that may import
    torchao (transformers imports parts of it whenever it is installed); every other record gets through."""
    import torch

    noise = {**_NOISE, **({} if torch.cuda.is_available() else _NOISE_WITHOUT_CUDA)}
    filters = [(logging.getLogger(logger), _DropKnownNoise(patterns)) for logger, patterns in noise.items()]
    for logger, dropper in filters:
        logger.addFilter(dropper)
    try:
        yield
    finally:
        for logger, dropper in filters:
            logger.removeFilter(dropper)


def import_quietly(name: str) -> ModuleType:
    """``importlib.import_module(name)`` under ``quiet_known_noise()``: every import of torchao goes through here."""
    with quiet_known_noise():
        return importlib.import_module(name)


def installed_version(distribution: str) -> "str | None":
    """The installed version of a distribution (``transformer-engine`` or ``transformer_engine``), None if missing."""
    import importlib.metadata

    for name in dict.fromkeys((distribution, distribution.replace("-", "_"))):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def version_of(distribution: str) -> str:
    """The installed version of a distribution, or "(not installed)", for messages."""
    return installed_version(distribution) or "(not installed)"


def _major_minor(version: str) -> str:
    """``"2.8"`` for ``"2.8.10+xpu"``."""
    return ".".join(version.split("+")[0].split(".")[:2])


def ipex_status() -> tuple[bool, str]:
    """Whether intel-extension-for-pytorch can be imported beside this torch, from package metadata alone.

    IPEX is archived (last release 2.8, pinned to torch 2.8) and calls ``os._exit(127)`` when imported beside another
    torch major.minor, killing the process: so it is never imported before this check passes.
    """
    import torch

    version = installed_version(IPEX)
    if version is None:
        return False, f"{IPEX} is not installed"
    if _major_minor(version) != _major_minor(torch.__version__):
        return False, (
            f"{IPEX} {version} is built for torch {_major_minor(version)}, this is torch {torch.__version__}"
            " (importing it would end the process)"
        )
    return True, f"{IPEX} {version}"


def load_ipex(mode: "bool | str") -> object:
    """``intel_extension_for_pytorch`` for ``ipex=True`` (or an error saying why not), for ``"auto"`` when it matches
    this torch (else None, quietly), None for ``False``."""
    if mode is False:
        return None
    usable, why = ipex_status()
    if not usable:
        if mode == "auto":
            return None
        raise RuntimeError(
            f"`XPUPrecision(ipex=True)`: {why}. Upstream torch >= 2.5 runs XPU without it: pass `ipex=False` (or"
            " 'auto'), or install the IPEX release that matches your torch."
        )
    import intel_extension_for_pytorch

    return intel_extension_for_pytorch


def imports_cleanly(module: str) -> tuple[bool, str]:
    """Whether ``module`` imports, tried in a child process, and the last line of its error: a broken build (torchvision
    for another torch) or IPEX beside the wrong torch (which calls ``os._exit``) must not take this process down."""
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    return proc.returncode == 0, last[:100]


def import_torchvision(need: str, instead: str) -> ModuleType:
    """torchvision, or a ``RuntimeError`` saying ``need`` and what to do ``instead``. It is in no extra (the registry's
    torchvision is a CUDA build that does not import beside a CPU torch), and a build for another torch installs but
    fails at import: so importing it is the check."""
    try:
        return importlib.import_module("torchvision")
    except Exception as err:  # not installed, or a build that does not match this torch
        raise RuntimeError(
            f"{need}, but torchvision cannot be imported here ({err}). Install the torchvision build that matches your"
            f" torch, or {instead}."
        ) from err
