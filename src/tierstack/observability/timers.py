"""Per-phase step timers: where a step's time goes, averaged over the log interval, slowest rank named.

The training loop's step function times each phase with :meth:`PhaseTimers.phase` (which is also
an NVTX range on GPU and a ``torch.profiler`` label, so ``nsys`` and the profiler trace show the
same names); data loading is timed by wrapping the data iterator (:meth:`PhaseTimers.timed`), so
``forward_backward`` is the schedule's time less the time spent waiting for batches.

At a log line, :meth:`PhaseTimers.take` gathers every rank's means (one small all-gather, a sync
point) and returns, per phase, the largest mean over ranks (the one that sets the pace, as
Megatron's timers report), and the slowest rank: the one whose forward steps computed longest
(:data:`FORWARD`; the phases that end in a collective take about as long everywhere); the full set goes to every logger, a short form to
the console line (:func:`short_summary`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Mapping, Optional

from tierstack import runtime
from tierstack.runtime import collectives

# Phases in console order, with their short console labels.
DATA, FORWARD_BACKWARD, OPTIMIZER, CHECKPOINT, EVAL = "data", "forward_backward", "optimizer", "checkpoint", "eval"
PHASES = (DATA, FORWARD_BACKWARD, OPTIMIZER, CHECKPOINT, EVAL)
_SHORT = {DATA: "data", FORWARD_BACKWARD: "fb", OPTIMIZER: "opt", CHECKPOINT: "ckpt", EVAL: "eval"}
# The forward steps' own compute inside forward_backward (their data waits taken out): no
# collective ends it on a data-parallel rank, so it names the slow rank, where every phase that
# ends in a gradient all-reduce takes about as long on every rank (the fast ones wait there).
FORWARD = "forward"
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
        self._seconds = dict.fromkeys(PHASES + (FORWARD,), 0.0)
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
                runtime.synchronize()  # GPU: the phase's kernels are done (a no-op on CPU)
                self._seconds[name] += time.perf_counter() - start

    def timed(self, iterator: Iterator) -> Iterator:
        """``iterator`` whose waits for the next item count as :data:`DATA` (and are taken out of
        the enclosing :data:`FORWARD_BACKWARD`, where megatron-core's schedule pulls batches)."""
        if not self.enabled:
            return iterator
        return _TimedIterator(iterator, self._seconds)

    def wrap_forward(self, forward_step_func):
        """``forward_step_func`` (megatron-core's ``(data_iterator, model) -> (output, loss_func)``)
        timed as :data:`FORWARD`, its data waits left out, inside an NVTX range ``forward``. (The
        backward passes run inside megatron-core's schedule: they are in ``forward_backward``.)"""
        if not self.enabled:
            return forward_step_func

        def timed_forward(data_iterator, model):
            start, waited = time.perf_counter(), self._seconds[DATA]
            try:
                with runtime.nvtx_range(FORWARD):
                    return forward_step_func(data_iterator, model)
            finally:
                self._seconds[FORWARD] += time.perf_counter() - start - (self._seconds[DATA] - waited)

        return timed_forward

    def step_done(self) -> None:
        """Count one training step (the denominator of the means)."""
        self._steps += 1

    def take(self, per_rank: Optional[Mapping[str, float]] = None) -> dict[str, float]:
        """Collective on every rank when enabled: per phase the largest mean seconds per step over
        ranks (``timers/<phase>_s``) and ``timers/slowest_rank`` (the rank with the largest total);
        then start a new window. Empty dict when disabled.

        ``per_rank``: more figures of this rank gathered in the same collective (the same keys on
        every rank, e.g. memory); each comes back as its largest value over ranks, with
        ``<key>_rank`` the rank that had it.
        """
        if not self.enabled:
            return {}
        steps = max(self._steps, 1)
        mine = [self._seconds[p] / steps for p in PHASES + (FORWARD,)]
        mine[PHASES.index(FORWARD_BACKWARD)] -= self._seconds[DATA] / steps  # data waits happen inside
        self._seconds, self._steps = dict.fromkeys(PHASES + (FORWARD,), 0.0), 0
        every = collectives.all_gather_object((mine, dict(per_rank or {})))
        out = {metric_key(p): max(means[i] for means, _ in every) for i, p in enumerate(PHASES + (FORWARD,))}
        pace = -1 if out[metric_key(FORWARD)] > 0 else slice(None)  # the forward compute, else the total
        out[SLOWEST_RANK] = max(range(len(every)), key=lambda r: _total(every[r][0][pace]))
        for key in per_rank or {}:
            top = max(range(len(every)), key=lambda r: every[r][1][key])
            out[key], out[f"{key}_rank"] = every[top][1][key], top
        return out


def _total(value) -> float:
    return sum(value) if isinstance(value, list) else value


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
