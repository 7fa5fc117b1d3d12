"""Per-phase step timers: where a step's time goes, averaged over the log interval, slowest rank named.

The training loop's step function times each phase with :meth:`PhaseTimers.phase` (which is also
an NVTX range on GPU and a ``torch.profiler`` label, so ``nsys`` and the profiler trace show the
same names); data loading is timed by wrapping the data iterator (:meth:`PhaseTimers.timed`), so
``forward_backward`` is the schedule's time less the time spent waiting for batches.

At a log line, :meth:`PhaseTimers.take` gathers every rank's means (one small all-gather, a sync
point) and returns, per phase, the largest mean over ranks (the one that sets the pace, as
Megatron's timers report) and which rank it was; the full set goes to every logger, a short form to
the console line (:func:`short_summary`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Mapping

from tierstack import runtime
from tierstack.runtime import collectives

# Phases in console order, with their short console labels.
DATA, FORWARD_BACKWARD, OPTIMIZER, CHECKPOINT, EVAL = "data", "forward_backward", "optimizer", "checkpoint", "eval"
PHASES = (DATA, FORWARD_BACKWARD, OPTIMIZER, CHECKPOINT, EVAL)
_SHORT = {DATA: "data", FORWARD_BACKWARD: "fb", OPTIMIZER: "opt", CHECKPOINT: "ckpt", EVAL: "eval"}
PREFIX = "timers/"
SLOWEST_RANK = PREFIX + "slowest_rank"


def metric_key(phase: str) -> str:
    """``timers/<phase>_s``: the logged key of a phase (mean seconds per step, largest over ranks)."""
    return f"{PREFIX}{phase}_s"


class PhaseTimers:
    """Accumulated seconds per phase since the last :meth:`take` on this rank.

    Args:
        enabled: False makes every method free (no timing, no collective in :meth:`take`);
            NVTX ranges are still pushed.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._seconds = dict.fromkeys(PHASES, 0.0)
        self._steps = 0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the enclosed code as phase ``name`` (one of :data:`PHASES`), inside an NVTX range."""
        with runtime.nvtx_range(name):
            if not self.enabled:
                yield
                return
            start = time.perf_counter()
            try:
                yield
            finally:
                self._seconds[name] += time.perf_counter() - start

    def timed(self, iterator: Iterator) -> Iterator:
        """``iterator`` whose waits for the next item count as :data:`DATA` (and are taken out of
        the enclosing :data:`FORWARD_BACKWARD`, where megatron-core's schedule pulls batches)."""
        if not self.enabled:
            return iterator
        return _TimedIterator(iterator, self._seconds)

    def step_done(self) -> None:
        """Count one training step (the denominator of the means)."""
        self._steps += 1

    def take(self) -> dict[str, float]:
        """Collective on every rank when enabled: per phase the largest mean seconds per step over
        ranks (``timers/<phase>_s``) and ``timers/slowest_rank`` (the rank with the largest total);
        then start a new window. Empty dict when disabled."""
        if not self.enabled:
            return {}
        steps = max(self._steps, 1)
        mine = [self._seconds[p] / steps for p in PHASES]
        mine[PHASES.index(FORWARD_BACKWARD)] -= self._seconds[DATA] / steps  # data waits happen inside
        self._seconds, self._steps = dict.fromkeys(PHASES, 0.0), 0
        every = collectives.all_gather_object(mine)
        out = {metric_key(p): max(rank_means[i] for rank_means in every) for i, p in enumerate(PHASES)}
        out[SLOWEST_RANK] = max(range(len(every)), key=lambda r: sum(every[r]))
        return out


class _TimedIterator:
    def __init__(self, inner: Iterator, seconds: dict) -> None:
        self._inner, self._seconds = inner, seconds

    def __iter__(self):
        return self

    def __next__(self):
        start = time.perf_counter()
        try:
            return next(self._inner)
        finally:
            self._seconds[DATA] += time.perf_counter() - start


def short_summary(metrics: Mapping[str, float]) -> str:
    """``fb 0.91 opt 0.08 data 0.01 ckpt 0.12 max r1`` (seconds per step): the console form of :meth:`PhaseTimers.take`
    (phases that took under 5 ms per step are left out; empty when there are no timers)."""
    parts = []
    for phase in (FORWARD_BACKWARD, OPTIMIZER, DATA, CHECKPOINT, EVAL):
        value = metrics.get(metric_key(phase))
        if value is not None and value >= 0.005:
            parts.append(f"{_SHORT[phase]} {value:.2f}")
    if not parts:
        return ""
    slowest = metrics.get(SLOWEST_RANK)
    return " ".join(parts) + (f" max r{int(slowest)}" if slowest is not None else "")
