"""nvidia-resiliency-ext straggler Detector on a machine without CUDA (see CPU_NOTES.md, item 8).

The Detector builds a CUPTI kernel profiler at initialize and calls ``torch.cuda.synchronize`` when
it reports; neither exists on a CPU-only build, and the CUPTI extension is missing on some GPU
installs too. Section (wall-clock) timing still works and is what a CPU run scores. This is device
knowledge, so it lives in ``runtime/``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Optional

import torch

from tierstack.runtime.distributed import has_gpu

log = logging.getLogger(__name__)

_cupti_warned = False


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


def _cupti_import_problem() -> Optional[str]:
    """Why NVRx's CUPTI extension (``nvrx_cupti_module``) does not import, or None when it does.

    The extension links ``libcupti.so.<CUDA major>``, which only some torch builds and CUDA installs
    bring; the Detector imports it lazily inside ``CuptiManager()``.
    """
    try:
        import nvrx_cupti_module  # noqa: F401
    except (ImportError, OSError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def kernel_profiling_available() -> bool:
    """True when the straggler Detector can profile CUDA kernels: a GPU and NVRx's CUPTI extension.

    On a GPU whose CUPTI extension does not import, straggler detection falls back to section timing
    (what a CPU run scores) and says so with one warning per process, instead of failing setup.
    """
    global _cupti_warned
    if not has_gpu():
        return False
    problem = _cupti_import_problem()
    if problem is None:
        return True
    if not _cupti_warned:
        _cupti_warned = True
        log.warning(
            "straggler detection: CUDA kernel profiling is off, section timing only: nvidia-resiliency-ext's "
            "CUPTI extension does not import (%s); it needs libcupti of the CUDA toolkit on the library path",
            problem,
        )
    return False


@contextlib.contextmanager
def detector_cpu_shims(kernel_profiling: bool = False) -> Iterator[None]:
    """Let the Detector run without CUPTI (and, on a CPU, without CUDA) for the duration of one call.

    ``Detector.initialize`` constructs ``CuptiManager`` by its module-level name, with no parameter to
    pass another: without kernel profiling it gets :class:`NoKernelProfiler`. On a CPU,
    ``Detector.generate_report`` calls ``torch.cuda.synchronize()``, replaced by a no-op. Both names are
    restored after the block, so nothing outlives the call; with kernel profiling on a GPU this is a
    no-op and the real CUPTI profiler and synchronize run.

    Args:
        kernel_profiling: the value of :func:`kernel_profiling_available` the caller decided on.
    """
    gpu = has_gpu()
    if kernel_profiling and gpu:
        yield
        return
    from nvidia_resiliency_ext.attribution.straggler import straggler as nvrx_straggler

    saved_manager = nvrx_straggler.CuptiManager
    saved_sync = torch.cuda.synchronize
    nvrx_straggler.CuptiManager = NoKernelProfiler
    if not gpu:
        torch.cuda.synchronize = lambda device=None: None  # CPU work is synchronous
    try:
        yield
    finally:
        nvrx_straggler.CuptiManager = saved_manager
        torch.cuda.synchronize = saved_sync
