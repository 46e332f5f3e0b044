"""Transformer Engine's own delayed-scaling state, for AmaxHistoryLogger: where TE keeps an amax history, its history
and scales replace what the logger's hooks measured."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["te_amax_history", "write_te_history"]


def te_amax_history(module: nn.Module) -> tuple[Tensor, Tensor] | None:
    """``(history [len, 3], scale [3])`` (input, weight, grad_output) from a Transformer Engine module's delayed
    scaling state: ``fp8_meta["scaling_fwd"]`` holds (input, weight, output) per GEMM, ``["scaling_bwd"]`` (grad_output,
    grad_input). None when the module keeps no amax (current scaling, MXFP8, block recipes)."""
    meta = getattr(module, "fp8_meta", None)
    if not isinstance(meta, dict) or "scaling_fwd" not in meta or "scaling_bwd" not in meta:
        return None
    fwd, bwd = meta["scaling_fwd"], meta["scaling_bwd"]
    if getattr(fwd, "amax_history", None) is None or getattr(bwd, "amax_history", None) is None:
        return None
    history = torch.stack([fwd.amax_history[:, 0], fwd.amax_history[:, 1], bwd.amax_history[:, 0]], dim=1)
    scale = torch.stack([fwd.scale[0], fwd.scale[1], bwd.scale[0]])
    return history, scale


def write_te_history(module: nn.Module, ring: Tensor, i: int, pos: int, history_len: int) -> Tensor | None:
    """TE's history of layer ``i`` (``module``) written into its column of the ``ring`` (slot ``pos`` the step in
    progress, TE's row 0), and TE's scale for it, on the ring's device; None where TE keeps none."""
    te_state = te_amax_history(module)
    if te_state is None:
        return None
    history, scale = te_state
    n = min(history_len, history.shape[0])
    rows = history[:n].to(ring)
    # TE's row r is our ring slot (pos + r) % history_len: two slices, no index tensor (which would be a host-to-device
    # copy every step)
    head = min(n, history_len - pos)
    ring[pos : pos + head, i] = rows[:head]
    ring[: n - head, i] = rows[head:]
    return scale.to(ring)
