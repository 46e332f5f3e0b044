"""Every optional dependency is checked here, and nowhere else.

Checks use package metadata (``RequirementCache``) so nothing is imported speculatively; the error names the pip
extra that installs the missing package; ``import_quietly`` imports one without the log lines known to be harmless.
"""

import importlib
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

from lightning_utilities.core.imports import RequirementCache

_TORCHAO_AVAILABLE = RequirementCache("torchao>=0.11")
_TRANSFORMER_ENGINE_AVAILABLE = RequirementCache("transformer-engine>=2.9")
_DATASETS_AVAILABLE = RequirementCache("datasets")
_TRANSFORMERS_AVAILABLE = RequirementCache("transformers")
_MATPLOTLIB_AVAILABLE = RequirementCache("matplotlib")

_EXTRA_OF = {
    "torchao": "fp8",
    "transformer-engine": "te",
    "datasets": "recipes",
    "transformers": "recipes",
    "matplotlib": "plots",
}


def require(available: RequirementCache, package: str, feature: str) -> None:
    """Raise a ``ModuleNotFoundError`` naming the extra to install when ``available`` is false."""
    if not available:
        extra = _EXTRA_OF[package]
        raise ModuleNotFoundError(
            f"{feature} needs `{package}`, which is not installed ({available.message}). "
            f"Install it with `pip install 'lightning-precision[{extra}]'`."
        )


# Log records known to be harmless, by logger. Without CUDA, torchao's CUDA kernels (`_C_mxfp8`, `_C_cutlass_90a`)
# cannot load and are never called, and it skips its C++ extensions on a torch it was not built for; on a GPU machine
# both may explain a failure, so they stay. torchao calls `register_constant` on enums, which torch >= 2.11 deprecates.
_NOISE_WITHOUT_CUDA = {
    "torchao": (r"^Failed to load .*torchao[\\/]_C[^\\/]*\.so: ",
                r"^Skipping import of cpp extensions due to incompatible torch version"),
}
_NOISE = {
    "torch.utils._pytree": (r"is an Enum subclass and is now natively supported .* Calling register_constant\(\) on Enum"
                            r" subclasses is deprecated",),
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


def ipex_status() -> tuple[bool, str]:
    """Whether intel-extension-for-pytorch can be imported beside this torch, from package metadata alone.

    IPEX is archived (last release 2.8, pinned to torch 2.8) and calls ``os._exit(127)`` when imported beside another
    torch major.minor, killing the process: so it is never imported before this check passes.
    """
    import importlib.metadata

    import torch

    try:
        version = importlib.metadata.version("intel-extension-for-pytorch")
    except importlib.metadata.PackageNotFoundError:
        return False, "intel-extension-for-pytorch is not installed"
    ours, theirs = torch.__version__.split("+")[0].split(".")[:2], version.split("+")[0].split(".")[:2]
    if ours != theirs:
        return False, (
            f"intel-extension-for-pytorch {version} is built for torch {'.'.join(theirs)}, this is torch"
            f" {torch.__version__} (importing it would end the process)"
        )
    return True, f"intel-extension-for-pytorch {version}"


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
