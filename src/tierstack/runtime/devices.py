"""Which device and collective backend this process uses: CUDA when torch can use it, else the CPU.

The lowest module of ``runtime`` (it imports nothing of tierstack), so that every other module of the
layer, collectives included, asks the same three functions.
"""

from __future__ import annotations

import torch


def has_gpu() -> bool:
    """True when a CUDA device can be used."""
    return torch.cuda.is_available()


def device() -> torch.device:
    """The device this rank computes on (``cuda:<local_rank>`` or ``cpu``)."""
    if has_gpu():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_backend() -> str:
    """``nccl`` on GPU, ``gloo`` on CPU."""
    return "nccl" if has_gpu() else "gloo"
