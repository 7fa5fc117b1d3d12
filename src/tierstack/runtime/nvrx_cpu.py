"""nvidia-resiliency-ext straggler Detector on a machine without CUDA (see CPU_NOTES.md, item 8).

The Detector builds a CUPTI kernel profiler at initialize and calls ``torch.cuda.synchronize`` when
it reports; neither exists on a CPU-only build. Section (wall-clock) timing still works and is what
a CPU run scores. This is device knowledge, so it lives in ``runtime/``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from tierstack.runtime.distributed import has_gpu


class NoKernelProfiler:
    """Stands in for nvidia-resiliency-ext's ``CuptiManager`` where no CUDA exists: records no kernels.

    It keeps the manager's contract (initialize before use; a stop needs a start) so that a misuse
    still fails the way it would on a GPU.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.is_initialized = False
        self.started_cnt = 0

    def initialize(self) -> None:
        self.is_initialized = True

    def shutdown(self) -> None:
        self.is_initialized = False
        self.started_cnt = 0

    def _ensure_initialized(self) -> None:
        if not self.is_initialized:
            raise RuntimeError("kernel profiler was not initialized")

    def start_profiling(self) -> None:
        self._ensure_initialized()
        self.started_cnt += 1

    def stop_profiling(self) -> None:
        self._ensure_initialized()
        if self.started_cnt == 0:
            raise RuntimeError("No active profiling run.")
        self.started_cnt -= 1

    def get_results(self) -> dict:
        self._ensure_initialized()
        return {}

    def reset_results(self) -> None:
        self._ensure_initialized()


@contextlib.contextmanager
def detector_cpu_shims() -> Iterator[None]:
    """On a CPU only: let the Detector run without CUDA for the duration of one call.

    ``Detector.initialize`` constructs ``CuptiManager`` by its module-level name, with no parameter to
    pass another, and ``Detector.generate_report`` calls ``torch.cuda.synchronize()``. Both names are
    replaced for the block and restored after it, so nothing outlives the call; on a GPU this is a
    no-op and the real CUPTI profiler and synchronize run.
    """
    if has_gpu():
        yield
        return
    from nvidia_resiliency_ext.straggler import straggler as nvrx_straggler

    saved_manager = nvrx_straggler.CuptiManager
    saved_sync = torch.cuda.synchronize
    nvrx_straggler.CuptiManager = NoKernelProfiler
    torch.cuda.synchronize = lambda device=None: None  # CPU work is synchronous
    try:
        yield
    finally:
        nvrx_straggler.CuptiManager = saved_manager
        torch.cuda.synchronize = saved_sync
