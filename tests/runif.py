"""Hardware gates as markers with a stated reason: a skipped test says what it needs."""

import pytest
import torch


def RunIf(cuda: bool = False, min_sm: tuple[int, int] = (0, 0)) -> pytest.MarkDecorator:  # noqa: N802 (Lightning's name)
    reasons = []
    if cuda and not torch.cuda.is_available():
        reasons.append("needs a CUDA device (none here)")
    elif cuda and torch.cuda.get_device_capability() < min_sm:
        reasons.append(f"needs CUDA compute capability >= {min_sm}, found {torch.cuda.get_device_capability()}")
    return pytest.mark.skipif(bool(reasons), reason="; ".join(reasons) or "runs")
