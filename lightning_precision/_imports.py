"""Every optional dependency is checked here, and nowhere else.

Checks use package metadata (``RequirementCache``) so nothing is imported speculatively; the error names the pip
extra that installs the missing package.
"""

from lightning_utilities.core.imports import RequirementCache

_TORCHAO_AVAILABLE = RequirementCache("torchao>=0.10")
_TRANSFORMER_ENGINE_AVAILABLE = RequirementCache("transformer-engine>=2.9")
_TORCHVISION_AVAILABLE = RequirementCache("torchvision")
_TRANSFORMERS_AVAILABLE = RequirementCache("transformers")
_MATPLOTLIB_AVAILABLE = RequirementCache("matplotlib")

_EXTRA_OF = {
    "torchao": "fp8",
    "transformer-engine": "te",
    "torchvision": "recipes",
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
