"""Small collective helpers that return values, for every package above ``runtime``.

Every function is a no-op reduction when torch.distributed is off, so the pure parts of the
checkpointing, resiliency and training code run in single-process tests. Each is a sync point.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def _device() -> torch.device:
    from tierstack import runtime

    return runtime.device()


def all_reduce_max(value: int) -> int:
    """Largest ``value`` over all ranks (a sync point)."""
    if not is_distributed():
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def any_true(flag: bool) -> bool:
    """True on every rank when ``flag`` holds on any rank (a sync point)."""
    return all_reduce_max(1 if flag else 0) == 1


def all_true(flag: bool) -> bool:
    """True only when ``flag`` holds on every rank (a sync point)."""
    return all_reduce_max(0 if flag else 1) == 0


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), indexed by rank, on every rank."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` (picklable), on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    if is_distributed():
        dist.barrier()
