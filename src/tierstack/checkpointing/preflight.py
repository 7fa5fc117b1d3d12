"""Preflight: nothing is published unless every parameter and gradient is finite on every rank."""

from __future__ import annotations

import logging
from typing import Iterable

import torch

from tierstack.checkpointing import _dist

log = logging.getLogger(__name__)


def _local_finite(model: Iterable[torch.nn.Module]) -> bool:
    for chunk in model:
        for p in chunk.parameters():
            if not bool(torch.isfinite(p.detach()).all()):
                return False
            # megatron DDP accumulates into ``main_grad`` (a view of its grad buffer)
            g = getattr(p, "main_grad", None)
            if g is None:
                g = p.grad
            if g is not None and not bool(torch.isfinite(g.detach()).all()):
                return False
    return True


def all_finite(model: Iterable[torch.nn.Module]) -> bool:
    """Collective: True when parameters and gradients are finite on every rank (a sync point)."""
    ok = _dist.all_true(_local_finite(model))
    if not ok:
        log.error("checkpoint preflight: non-finite parameters or gradients on some rank; nothing is saved")
    return ok
