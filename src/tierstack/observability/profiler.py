"""``torch.profiler`` over a window of training steps (the ``profile`` section).

On each rank of ``profile.ranks``, the profiler records CPU activity (and CUDA on GPU) from the
start of iteration ``profile.step_start`` to the end of ``profile.step_end``, then writes, under
``<run_dir>/profile/``:

- ``rank<r>_steps<a>-<b>.trace.json``: a Chrome trace (open it at https://ui.perfetto.dev or in
  ``chrome://tracing``); the phases of each step are labelled (``forward_backward``, ``optimizer``,
  ``checkpoint``, ...), as are NVTX ranges on GPU;
- ``rank<r>_steps<a>-<b>.top_operators.txt``: the top operators by self time (CPU; CUDA on GPU).

The window is owned by the training loop's step function: :meth:`StepProfiler.step_begin` before
a step, :meth:`StepProfiler.step_end` after it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from tierstack import runtime
from tierstack.config.sections import ProfileConfig

log = logging.getLogger(__name__)

PROFILE_DIR = "profile"


class StepProfiler:
    """The profiler window of one rank (does nothing when off or on a rank not profiled).

    Args:
        cfg: the ``profile`` section.
        run_dir: the run directory; files go to ``<run_dir>/profile/``.
        rank: global rank of this process.
    """

    def __init__(self, cfg: ProfileConfig, run_dir: str | Path, rank: int) -> None:
        self.cfg = cfg
        self.enabled = cfg.enabled and rank in cfg.ranks
        self.rank = rank
        self.out_dir = Path(run_dir) / PROFILE_DIR
        self._prof = None
        self.trace_path: Optional[Path] = None
        self.table_path: Optional[Path] = None

    def step_begin(self, step: int) -> None:
        """Before iteration ``step`` (1-based) runs: start the profiler at ``profile.step_start``."""
        if not self.enabled or self._prof is not None or step != self.cfg.step_start:
            return
        import torch.profiler

        self._prof = torch.profiler.profile(activities=runtime.profiler_activities(), record_shapes=True)
        self._prof.__enter__()
        log.info("profiler: recording iterations %d-%d on rank %d", self.cfg.step_start, self.cfg.step_end, self.rank)

    def step_end(self, step: int) -> None:
        """After iteration ``step``: at ``profile.step_end`` (or later), stop and write the files."""
        if self._prof is None or step < self.cfg.step_end:
            return
        self.close()

    def close(self) -> None:
        """Stop a running profiler and write its files (a run that stopped inside the window still
        gets them); idempotent."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = f"rank{self.rank}_steps{self.cfg.step_start}-{self.cfg.step_end}"
        self.trace_path = self.out_dir / f"{stem}.trace.json"
        prof.export_chrome_trace(str(self.trace_path))
        sort_by = "self_device_time_total" if runtime.has_gpu() else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=self.cfg.top_operators)
        self.table_path = self.out_dir / f"{stem}.top_operators.txt"
        self.table_path.write_text(table + "\n")
        log.info("profiler: trace %s, top operators %s", self.trace_path, self.table_path)
