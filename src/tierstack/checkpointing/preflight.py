"""Preflight: nothing is published unless every parameter and gradient is finite on every rank."""

from __future__ import annotations

import logging
from typing import Iterable

import torch

from tierstack.checkpointing import _dist

log = logging.getLogger(__name__)


def _local_finite(model: Iterable[torch.nn.Module]) -> bool:
    """True when every parameter and gradient of this rank is finite.

    One float64 sum per tensor (a NaN or inf anywhere makes the sum non-finite; float64 cannot
    overflow on finite fp32/bf16 values), then a single check: no tensor-sized boolean temporaries
    and, on GPU, one device sync instead of one per tensor.
    """
    sums = []
    for chunk in model:
        for p in chunk.parameters():
            sums.append(p.detach().sum(dtype=torch.float64))
            # megatron DDP accumulates into ``main_grad`` (a view of its grad buffer)
            g = getattr(p, "main_grad", None)
            if g is None:
                g = p.grad
            if g is not None:
                sums.append(g.detach().sum(dtype=torch.float64))
    if not sums:
        return True
    return bool(torch.isfinite(torch.stack(sums)).all())


def all_finite(model: Iterable[torch.nn.Module]) -> bool:
    """Collective: True when parameters and gradients are finite on every rank (a sync point)."""
    ok = _dist.all_true(_local_finite(model))
    if not ok:
        log.error("checkpoint preflight: non-finite parameters or gradients on some rank; nothing is saved")
    return ok
