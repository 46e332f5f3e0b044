"""Issue 14's renames keep every old public name working, with a DeprecationWarning naming the new one."""

import pytest
from torch import nn

from lightning_precision.callbacks import AmaxHistoryLogger


def test_amax_logger_step_is_now_end_step():
    logger = AmaxHistoryLogger(history_len=4, what_if=False)
    logger.attach(nn.Sequential(nn.Linear(8, 8)))
    with pytest.warns(DeprecationWarning, match=r"AmaxHistoryLogger.step\(\).*end_step\(\)"):
        logger.step(log=False)
    assert logger.steps == 1
    logger.end_step(log=False)
    assert logger.steps == 2
