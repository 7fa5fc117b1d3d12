"""Preflight: nothing is published unless every parameter and gradient is finite on every rank."""

from __future__ import annotations

import logging
from typing import Iterable

import torch

from tierstack.runtime import collectives as _dist

log = logging.getLogger(__name__)


def _local_finite(model: Iterable[torch.nn.Module]) -> bool:
    """True when every parameter and gradient of this rank is finite.

    Per tensor, its max and min: both propagate NaN and are +-inf exactly when the tensor holds an
    inf, they cannot overflow (a sum can), and each is one vectorised pass with no tensor-sized
    temporary (``isfinite(t).all()`` allocates one; a float64 sum is ~30x slower on CPU). One
    final check, so one device sync on GPU instead of one per tensor.
    """
    extremes = []
    for chunk in model:
        for p in chunk.parameters():
            # megatron DDP accumulates into ``main_grad`` (a view of its grad buffer)
            g = getattr(p, "main_grad", None)
            if g is None:
                g = p.grad
            for t in (p, g):
                if t is not None and t.numel():
                    t = t.detach()
                    extremes += [t.amax().float(), t.amin().float()]
    if not extremes:
        return True
    return bool(torch.isfinite(torch.stack(extremes)).all())


def all_finite(model: Iterable[torch.nn.Module]) -> bool:
    """Collective: True when parameters and gradients are finite on every rank (a sync point)."""
    ok = _dist.all_true(_local_finite(model))
    if not ok:
        log.error("checkpoint preflight: non-finite parameters or gradients on some rank; nothing is saved")
    return ok
