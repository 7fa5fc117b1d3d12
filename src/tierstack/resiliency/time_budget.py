"""``train.exit_duration_in_mins``: a job's time budget, counted from its start.

The job starts when its launcher does: under torchrun the rank's agent (its parent process), which
outlives restarts of the ranks, so a restarted rank keeps the budget of the job it belongs to;
otherwise this process. Before each step the loop asks :meth:`TimeBudget.would_pass` whether the
next step, the final GLOBAL save and the close after it would pass the budget
(``training.train.final_save_estimate_s``, ``EXIT_RESERVE_S``); if so on any rank, every rank
saves and stops (a planned exit, status 0).
"""

from __future__ import annotations

import os
import time
from typing import Optional

REASON_PREFIX = "train.exit_duration_in_mins="  # how a stop reason of the budget starts


def job_start_time() -> float:
    """Unix time the job started: the torchrun agent's start under torchrun, else this process's."""
    import psutil

    me = psutil.Process()
    start = me.create_time()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        parent = me.parent()
        if parent is not None:
            start = min(start, parent.create_time())
    return start


class TimeBudget:
    """A time budget of ``minutes`` from ``start`` (unix seconds; default :func:`job_start_time`).

    Args:
        minutes: the budget, minutes (> 0).
        start: when the job started, unix seconds.
        clock: the current unix time (tests pass their own).

    Raises:
        ValueError: ``minutes`` is not > 0.
    """

    def __init__(self, minutes: float, start: Optional[float] = None, clock=time.time) -> None:
        if not minutes > 0:
            raise ValueError(f"train.exit_duration_in_mins={minutes}: must be > 0 minutes")
        self.minutes = minutes
        self.start = job_start_time() if start is None else start
        self._clock = clock

    @property
    def deadline(self) -> float:
        """Unix time the budget ends."""
        return self.start + 60.0 * self.minutes

    def elapsed_s(self) -> float:
        """Seconds since the job started."""
        return self._clock() - self.start

    def would_pass(self, next_step_s: float, final_save_s: float) -> bool:
        """True when another step of ``next_step_s`` seconds followed by a final save of
        ``final_save_s`` seconds would end after the deadline."""
        return self._clock() + next_step_s + final_save_s > self.deadline

    def reason(self) -> str:
        """The stop reason logged and tagged in the trackers."""
        return (f"{REASON_PREFIX}{self.minutes:g} reached ({self.elapsed_s() / 60:.2f} min since "
                "the job started; the next step and the final save would pass it)")
