"""What profiling needs to know of the device: NVTX ranges, profiler activities, memory figures.

On GPU, :func:`nvtx_range` pushes an NVTX range (``nsys profile`` shows it) and
:func:`memory_report` gives the peak allocated/reserved CUDA memory; on CPU the range is only a
``torch.profiler.record_function`` label and the memory figure is the resident set size.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from tierstack.runtime.distributed import has_gpu

_GIB = float(1 << 30)


@contextlib.contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    """Label the enclosed code ``name``: an NVTX range on GPU, a profiler label on both devices
    (a profiler label costs a few microseconds when no profiler runs)."""
    with torch.profiler.record_function(name):
        if has_gpu():
            torch.cuda.nvtx.range_push(name)
            try:
                yield
            finally:
                torch.cuda.nvtx.range_pop()
        else:
            yield


def profiler_activities() -> list:
    """``torch.profiler`` activities of this device: CPU, and CUDA on GPU."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if has_gpu():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


def memory_report() -> dict[str, float]:
    """This rank's memory, GiB: ``memory/peak_allocated_gib`` and ``memory/peak_reserved_gib``
    (CUDA, since the start) on GPU; ``memory/rss_gib`` (resident set size) on CPU."""
    if has_gpu():
        return {"memory/peak_allocated_gib": torch.cuda.max_memory_allocated() / _GIB,
                "memory/peak_reserved_gib": torch.cuda.max_memory_reserved() / _GIB}
    import psutil

    return {"memory/rss_gib": psutil.Process().memory_info().rss / _GIB}
