"""CPU compatibility layer for megatron-core 0.16 (activated only when CUDA is unavailable).

megatron-core assumes CUDA in a handful of places (see ../shared/CPU_NOTES.md, probed on 0.16.1):

1. ``torch.cuda.current_device()`` used as a device for allocations;
2. the CUDA RNG tracker (``tensor_parallel.random``) reads/sets CUDA generator state;
3. ``device='cuda'`` and ``.cuda()`` in optimizer constructors and in the pipeline schedules
   (a token counter is allocated on every step);
4. ``Tensor.type() == 'torch.cuda.FloatTensor'`` checks in the (distributed) optimizer and clipping;
5. ``torch.cuda.synchronize`` / ``device_count`` / ``manual_seed`` / streams / events.

The layer answers each of these without touching CUDA: a small set of ``torch.cuda`` functions are
replaced by CPU equivalents, the megatron RNG helpers are pointed at the CPU generator, and a
``TorchFunctionMode`` (:class:`CudaToCpuMode`) rewrites CUDA device arguments to the CPU. The mode
costs one Python call per torch op; ``scripts/bench_cpu_compat.py`` measures it side by side.

Nothing here runs on a machine with CUDA: :func:`activate` refuses to.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_ACTIVE = False
_MODE: "CudaToCpuMode | None" = None

_CPU = torch.device("cpu")
# Tensor.type() names megatron compares against, per dtype.
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _is_cuda_device(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    # An int device is a CUDA ordinal in torch's API (megatron passes current_device()).
    return isinstance(dev, int) and not isinstance(dev, bool)


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU for every torch call made while active.

    Handles ``device=`` keywords (``"cuda"``, ``"cuda:N"``, ``torch.device("cuda")``, ints),
    ``Tensor.cuda()``, ``Tensor.to("cuda")`` and the no-argument ``Tensor.type()`` that megatron
    compares with ``'torch.cuda.FloatTensor'``.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if dev is not None and _is_cuda_device(dev):
            kwargs = dict(kwargs, device=_CPU)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU) + tuple(args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = _CUDA_TYPE_NAMES.get(args[0].dtype)
            if name is not None:
                return name
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for ``torch.cuda.Stream`` / ``current_stream()`` on the CPU: work is synchronous."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> "_NullEvent":
        return event or _NullEvent()

    def __enter__(self) -> "_NullStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _NullEvent:
    """Stands in for ``torch.cuda.Event``: records wall time so elapsed_time still means something."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._t = None

    def record(self, stream: Any = None) -> None:
        import time

        self._t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_NullEvent") -> float:
        """Milliseconds between two recorded events."""
        if self._t is None or end._t is None:
            return 0.0
        return (end._t - self._t) * 1000.0


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.synchronize = lambda device=None: None
    cuda.device_count = lambda: 1
    cuda.set_device = lambda device: None
    cuda.empty_cache = lambda: None
    # torch.manual_seed itself calls cuda.manual_seed_all: seed the CPU generator directly.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.current_stream = lambda device=None: _NullStream()
    cuda.default_stream = lambda device=None: _NullStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.memory_reserved = lambda device=None: 0


def _patch_megatron_rng() -> None:
    """Point megatron's CUDA RNG helpers at the CPU default generator.

    ``_set_cuda_rng_state`` defers through ``torch.cuda._lazy_call``, which on a CPU build queues
    the call forever; the tracker's ``fork()`` would then silently reuse one stream.
    """
    from megatron.core.tensor_parallel import random as mrandom

    # On the CPU the tracker's "CUDA" stream *is* the CPU generator, so its check that the CPU state
    # did not change inside fork() always fires; fork() still restores it, so the warning is noise.
    logging.getLogger(mrandom.__name__).addFilter(
        lambda record: "CPU RNG state changed within GPU RNG context" not in record.getMessage()
    )
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)


def _patch_megatron_masks() -> None:
    """Build the causal mask on the CPU once per sequence length.

    megatron-core 0.16 builds it with ``device="cuda"`` on every attention call
    (``transformer.utils.get_default_causal_mask``); a cached CPU version keeps the model's forward
    and backward free of the device-rewriting mode's per-op cost.
    """
    import functools

    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    @functools.lru_cache(maxsize=16)
    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    tutils.get_default_causal_mask = causal_mask
    if hasattr(fused_softmax, "get_default_causal_mask"):
        fused_softmax.get_default_causal_mask = causal_mask


def activate() -> None:
    """Install the CPU layer for this process (idempotent).

    Raises:
        RuntimeError: when CUDA is available; the GPU path must never run through this layer.
    """
    global _ACTIVE, _MODE
    if _ACTIVE:
        return
    if torch.cuda.is_available():
        raise RuntimeError("tierstack CPU compatibility layer refused: CUDA is available")
    _patch_torch_cuda()
    _patch_megatron_rng()
    _patch_megatron_masks()
    _MODE = CudaToCpuMode()
    _MODE.__enter__()
    _ACTIVE = True


def deactivate() -> None:
    """Leave the device-rewriting mode (the torch.cuda replacements stay; they are harmless on CPU)."""
    global _ACTIVE, _MODE
    if _MODE is not None:
        _MODE.__exit__(None, None, None)
        _MODE = None
    _ACTIVE = False


def is_active() -> bool:
    """True when the CPU layer is installed in this process."""
    return _ACTIVE


@contextlib.contextmanager
def suspended():
    """Run a block without the device-rewriting mode (used to measure its cost)."""
    if _MODE is None:
        yield
        return
    _MODE.__exit__(None, None, None)
    try:
        yield
    finally:
        _MODE.__enter__()
