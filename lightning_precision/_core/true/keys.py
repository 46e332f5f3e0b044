"""The keys the true-precision step keeps in an optimizer's state beside the user's, and how it recognises a state.

Every tensor among them is kept in the weight's dtype (integers as bit patterns, exponents as small integers that dtype
holds exactly): ``Optimizer.load_state_dict`` casts every state tensor to its parameter's dtype, and a cast to the same
dtype changes no bit. A state stored in any form but its own value is stored under a key of ours only, never under the
optimizer's name: a checkpoint resumed by another precision then fails to find the state instead of training on
encoded values.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["BLOCK", "CODES", "EXP", "FP16_TOP", "HIGH", "LOW", "MIN_8BIT", "NON_NEGATIVE", "PLUGIN_OF", "REMAINDER",
           "ROUNDS", "SCALED", "SCALES", "SQUARED", "STATE_PREFIX", "WRITTEN_BY", "check_readable_states",
           "is_low_bit", "is_moment", "is_own_key", "is_scalar_fp32"]

STATE_PREFIX = "lp."
REMAINDER = STATE_PREFIX + "remainder"
ROUNDS = STATE_PREFIX + "rounds"
EXP = STATE_PREFIX + "exp."
# An fp16 state at its power of two, under a key of ours: under torch's own name, a checkpoint resumed by another
# precision (Lightning's, plain torch) would read the scaled values as the state, silently; so it fails to find it.
SCALED = STATE_PREFIX + "f16."
# An fp32 value's two 16-bit halves: an fp32 optimizer state (`optimizer_states="float32"`), and an optimizer's own
# fp32 values that are not per-element states (NAdam's `mu_product`, ASGD's `eta`, Adafactor's factored moments), which
# torch's load would otherwise cast to the weight dtype: the resumed run would differ from the uninterrupted one.
HIGH = STATE_PREFIX + "hi."
LOW = STATE_PREFIX + "lo."
CODES = STATE_PREFIX + "q8."
SCALES = STATE_PREFIX + "q8scale."
# A param-group key: the weight dtype whose step wrote the group's states. Their 16-bit encodings (remainders, fp32
# states' halves, 8-bit codes, fp16 states at a power of two) mean nothing in the other 16-bit dtype, and torch casts
# them to it on load: a checkpoint of one plugin resumed by the other would step on garbage states.
WRITTEN_BY = STATE_PREFIX + "dtype"
PLUGIN_OF = {"bfloat16": "BF16TruePrecision", "float16": "FP16TruePrecision"}
# States that are never negative: torchao's unsigned 8-bit map gives them its 256 codes.
NON_NEGATIVE = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "acc_delta", "exp_inf"})
# States that are sums of squares (Adam's second moment, Adagrad's sum, RMSprop's average, Adadelta's deltas): their
# range is the square of the gradients', wider than fp16 holds at one power of two when the gradients of one tensor span
# more than about 6 decades. Stored in fp16 as their square roots (the gradients' own range), squared when read.
SQUARED = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "acc_delta"})
BLOCK = 256  # torchao's 8-bit block; smaller tensors (and those not a whole number of blocks) stay 16-bit
MIN_8BIT = 4096  # torchao's own low-bit optimizers keep tensors under 4096 elements in full precision
# An fp16 state is stored times 2**e, with e chosen so that its largest element lands in [2**13, 2**14): headroom below
# 65504, and 2**-24 * 2**-13 of the largest element still representable.
FP16_TOP = 14


def is_own_key(key: Any) -> bool:
    return isinstance(key, str) and key.startswith(STATE_PREFIX)


def is_low_bit(value: Any) -> bool:
    """A state of one of torchao's low-bit optimizers (``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``) the user chose."""
    return type(value).__name__.startswith("OptimState")


def is_moment(key: Any, value: Any, param: Tensor) -> bool:
    """A state the step converts: a floating tensor of the parameter's shape (not a step counter, not ours)."""
    return (isinstance(value, Tensor) and not is_own_key(key) and key != "step" and param.dim() > 0
            and value.shape == param.shape and (value.is_floating_point() or is_low_bit(value)))


def is_scalar_fp32(key: Any, value: Any, param: Tensor) -> bool:
    """An optimizer's own fp32 value that is not a per-element state (NAdam's ``mu_product``, Adafactor's row and
    column moments): kept as its two halves (``HIGH``/``LOW``), which torch's load leaves as they are."""
    return (isinstance(value, Tensor) and not is_low_bit(value) and not is_own_key(key) and key != "step"
            and value.dtype == torch.float32 and not is_moment(key, value, param))


def check_readable_states(owner: str, optimizer: Any) -> None:
    """Raise where ``optimizer``'s states are stored in a true-precision plugin's encoding (a checkpoint of
    ``BF16TruePrecision``/``FP16TruePrecision`` loaded into another precision): the optimizer would not find them
    (a bare ``KeyError``). Each state dict is looked at once (a load replaces it): a host walk over the keys, no op."""
    states = getattr(optimizer, "state", None)  # (an optimizer-like object may keep none)
    if not isinstance(states, Mapping) or _CHECKED.get(optimizer) is states:
        return
    for state in states.values():
        if not isinstance(state, dict):
            continue
        for key in state:
            if not isinstance(key, str) or not key.startswith((SCALED, HIGH, CODES)):
                continue
            name = key.split(".", 2)[2]
            if name in state:
                continue
            groups = getattr(optimizer, "param_groups", [])
            written = next((group[WRITTEN_BY] for group in groups if WRITTEN_BY in group), None)
            writer = PLUGIN_OF.get(written, "a true-precision plugin") if written else "a true-precision plugin"
            raise ValueError(
                f"`{owner}` cannot step `{type(optimizer).__name__}`: its states were written by `{writer}` (a"
                f" checkpoint of it was loaded), which stores {name!r} encoded, under {key!r}; the optimizer would not"
                f" find it. Resume with `{writer}`, or load the model's weights alone (e.g."
                " `LightningModule.load_from_checkpoint`) and start the optimizer afresh."
            )
    try:
        _CHECKED[optimizer] = states
    except TypeError:  # (an optimizer-like object without weak references: checked every step)
        pass


# The state dict each optimizer's was checked as (the optimizer's own, until a load replaces it).
_CHECKED: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
