"""Hardware gates as markers with a stated reason: a skipped test says what it needs."""

import os

import pytest
import torch

# The cuda tier (tests marked `cuda`) runs on a CUDA device; with this variable set to "cpu" it runs on the CPU instead
# (fp8 emulated): a check of the tier's own code, which says nothing about CUDA.
CUDA_TIER_VARIABLE = "LIGHTNING_PRECISION_CUDA_TIER"
NO_CUDA = f"needs a CUDA device (none here; {CUDA_TIER_VARIABLE}=cpu runs the cuda tier's own checks on the CPU)"


def cuda_tier_device() -> str | None:
    """Where the cuda tier runs: "cuda", "cpu" when asked by ``CUDA_TIER_VARIABLE``, None (skipped) otherwise."""
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get(CUDA_TIER_VARIABLE) == "cpu" else None


def RunIf(cuda: bool = False, min_sm: tuple[int, int] = (0, 0)) -> pytest.MarkDecorator:  # noqa: N802 (Lightning's name)
    reasons = []
    if cuda and not torch.cuda.is_available():
        reasons.append("needs a CUDA device (none here)")
    elif cuda and torch.cuda.get_device_capability() < min_sm:
        reasons.append(f"needs CUDA compute capability >= {min_sm}, found {torch.cuda.get_device_capability()}")
    return pytest.mark.skipif(bool(reasons), reason="; ".join(reasons) or "runs")
